"""Measurements for run.json: peak memory of one step, the environment, throughput."""
from __future__ import annotations

import contextlib
import platform

import weakref

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary


class LiveTensorBytes(TorchDispatchMode):
    """Exact count of live tensor bytes on CPU: every storage that exists when the mode starts
    (parameters, gradients, optimizer states, buffers) plus every storage an op creates while it
    is on, each counted once (views share a storage) until Python frees it. `peak_bytes` is the
    highest total seen. DTensors are counted by their local shards."""

    def __init__(self):
        super().__init__()
        self.live = WeakIdKeyDictionary()
        self.current_bytes = 0
        self.peak_bytes = 0

    def _release(self, nbytes: int) -> None:
        self.current_bytes -= nbytes

    def track(self, t) -> None:
        if isinstance(t, DTensor):
            t = t._local_tensor
        if not isinstance(t, torch.Tensor) or t.device.type == "meta" or type(t) is not torch.Tensor and \
                not isinstance(t, torch.nn.Parameter):
            return
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        if st in self.live:
            return
        nbytes = st.nbytes()
        self.live[st] = nbytes
        weakref.finalize(st, self._release, nbytes)
        self.current_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            self.track(t)
        return out


class PeakMemory:
    """Peak bytes of one training step on this rank: torch.cuda.max_memory_allocated on GPU,
    LiveTensorBytes on CPU."""

    def __init__(self, device: torch.device, modules, optimizers):
        self.device, self.modules, self.optimizers = device, modules, optimizers
        self.bytes: int | None = None

    @contextlib.contextmanager
    def measure(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            yield
            torch.cuda.synchronize(self.device)
            self.bytes = int(torch.cuda.max_memory_allocated(self.device))
            return
        counter = LiveTensorBytes()
        for m in self.modules:
            for t in [*m.parameters(), *m.buffers()]:
                counter.track(t)
                if t.grad is not None:
                    counter.track(t.grad)
        for opt in self.optimizers:
            for t in pytree.tree_leaves(opt.state_dict()["state"]):
                counter.track(t)
        with counter:
            yield
        self.bytes = counter.peak_bytes


def environment(backend: str, device: torch.device) -> dict:
    if device.type == "cuda":
        names = [torch.cuda.get_device_name(device)]
    else:
        names = [platform.processor() or platform.machine() or "cpu"]
    all_names = [None] * dist.get_world_size()
    dist.all_gather_object(all_names, names[0])
    return {
        "torch": torch.__version__,
        "backend": backend,
        "device_type": device.type,
        "device_names": sorted(set(all_names)),
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }


def gather(value) -> list:
    """The value of every rank, in rank order."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out
