"""The device a rank computes on, and timing work on it.

A rank whose machine has GPUs computes on the GPU of its local rank and talks over NCCL; otherwise
it computes on the CPU and talks over gloo. The choice is made once per process (`init`), by
runtime.train and runtime.profile alike, so that the profilers measure the device the runtime
trains on. GPU work is asynchronous: a time read on the host counts the work queued before it
only after a synchronization, so `timed` synchronizes before and after.
"""
from __future__ import annotations

import glob
import time

import torch

_CURRENT = torch.device("cpu")


def gpus_short(ranks_per_node: int) -> str | None:
    """Why `ranks_per_node` ranks cannot each have a GPU of this machine (None when they can, or
    when it has none: then they run on the CPU)."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if 0 < n < ranks_per_node:
        return (f"{ranks_per_node} ranks per node need a GPU each and this machine has {n}; plan for {n} "
                f"(trident search --gpus {n}), or hide the GPUs (CUDA_VISIBLE_DEVICES=) to check the plan on the CPU")
    return None


def init(local_rank: int) -> tuple[str, torch.device]:
    """(backend, device) of this process: its local rank's GPU with NCCL, or the CPU with gloo.
    Raises ConfigError when the machine has GPUs, but not one for this rank."""
    global _CURRENT
    if torch.cuda.is_available():
        if local_rank >= torch.cuda.device_count():
            from planner.model import ConfigError
            raise ConfigError(gpus_short(local_rank + 1))
        _CURRENT = torch.device("cuda", local_rank)
        torch.cuda.set_device(_CURRENT)
        return "nccl", _CURRENT
    _CURRENT = torch.device("cpu")
    return "gloo", _CURRENT


def current() -> torch.device:
    """The device `init` chose (the CPU before it runs)."""
    return _CURRENT


def sync(device: torch.device | None = None) -> None:
    """Wait for the work queued on `device` (default: the current one); nothing to wait for on CPU."""
    device = device or _CURRENT
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device | None = None) -> float:
    """Seconds `fn()` takes on `device`, its queued work included."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def scalar(x: float, dtype=torch.float64) -> torch.Tensor:
    """A one-element tensor on the current device: what a collective of the current backend takes
    (NCCL reduces GPU tensors only)."""
    return torch.tensor([x], dtype=dtype, device=_CURRENT)


def last_level_cache_bytes(device: torch.device | None = None, sysfs: str = "/sys/devices/system/cpu/cpu0/cache") -> int:
    """The largest cache of `device`: a GPU's L2, or the CPU's last level as Linux lists it under
    `sysfs` (index*/size, e.g. "32768K"); 32 MiB where neither says."""
    device = device or _CURRENT
    if device.type == "cuda":
        return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)) or 32 << 20
    sizes = []
    for path in glob.glob(f"{sysfs}/index*/size"):
        try:
            text = open(path).read().strip().upper()
            sizes.append(int(text.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(text[-1:], 0))
        except (OSError, ValueError):
            continue
    return max(sizes, default=0) or 32 << 20
