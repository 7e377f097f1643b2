"""The device a rank computes on, and timing work on it.

A rank whose machine has GPUs computes on the GPU of its local rank and talks over NCCL; otherwise
it computes on the CPU and talks over gloo. The choice is made once per process (`init`), by
runtime.train and runtime.profile alike, so that the profilers measure the device the runtime
trains on. GPU work is asynchronous: a time read on the host counts the work queued before it
only after a synchronization, so `timed` synchronizes before and after.
"""
from __future__ import annotations

import time

import torch

_CURRENT = torch.device("cpu")


def init(local_rank: int) -> tuple[str, torch.device]:
    """(backend, device) of this process: its local rank's GPU with NCCL, or the CPU with gloo."""
    global _CURRENT
    if torch.cuda.is_available():
        _CURRENT = torch.device("cuda", local_rank % torch.cuda.device_count())
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
