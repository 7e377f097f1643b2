"""Measurements for run.json: peak memory of one step, the environment, throughput; the
per-step metrics log (--metrics)."""
from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import platform
import weakref
from pathlib import Path

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


class _MallInfo2(ctypes.Structure):  # glibc >= 2.33, struct mallinfo2 (malloc.h)
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]


def _heap_reader():
    """A function giving the bytes the C heap has handed out and not taken back (glibc mallinfo2:
    in-use bytes of every arena + bytes in mmap'd chunks), or None where there is none."""
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2

    def read() -> int:
        m = fn()
        return int(m.uordblks + m.hblkhd)
    return read


class HeapPeak(TorchDispatchMode):
    """Peak bytes allocated on CPU while it is on, sampled after every op but views: the C heap's in-use
    bytes (PyTorch's CPU allocator takes its tensors from malloc) above their value at the start.
    It sees what is really allocated and freed: a view of a parameter allocates nothing, and
    storage that FSDP2 frees by resizing it to zero is given back (a storage-identity count,
    LiveTensorBytes, sees neither)."""

    _primed = False  # see __enter__

    def __init__(self, read):
        super().__init__()
        self.read = read
        self.start = self.peak = 0

    def __enter__(self):
        if not HeapPeak._primed:  # the first dispatch mode of a process builds Python-side caches (~9 MB)
            HeapPeak._primed = True
            with HeapPeak(self.read):
                torch.zeros(2).add_(1).sum()
        self.start = self.peak = self.read()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:  # a view allocates no storage; glibc's count walks the free lists (~30 us)
            self.peak = max(self.peak, self.read())
        return out

    @property
    def peak_bytes(self) -> int:
        return self.peak - self.start

    @property
    def current_bytes(self) -> int:
        return self.read() - self.start


HEAP_READER = _heap_reader()


def cpu_counter():
    """The CPU memory counter this machine supports: HeapPeak where the C library reports its heap
    (glibc), else LiveTensorBytes; and the name run.json records."""
    if HEAP_READER is not None:
        return HeapPeak(HEAP_READER), "C heap in use, sampled after every op (runtime.metrics.HeapPeak)"
    return LiveTensorBytes(), "live tensor storages (runtime.metrics.LiveTensorBytes)"


class CudaAllocated:
    """Bytes PyTorch's CUDA caching allocator hands out, above their value at the start, with the
    peak since (HeapPeak's interface, on a GPU)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.start = 0

    def __enter__(self):
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.start = torch.cuda.memory_allocated(self.device)
        return self

    def __exit__(self, *exc):
        torch.cuda.synchronize(self.device)
        return False

    @property
    def current_bytes(self) -> int:
        return torch.cuda.memory_allocated(self.device) - self.start

    @property
    def peak_bytes(self) -> int:
        return torch.cuda.max_memory_allocated(self.device) - self.start


def memory_counter(device: torch.device):
    """The memory counter of `device` and the name a profile records: CudaAllocated on a GPU,
    cpu_counter() on the CPU."""
    if device.type == "cuda":
        return CudaAllocated(device), "torch.cuda.memory_allocated above its value at the start"
    return cpu_counter()


class PeakMemory:
    """Peak bytes of one training step on this rank: torch.cuda.max_memory_allocated on GPU; on
    CPU the bytes of the tensors alive at the start (parameters, gradients, optimizer states,
    buffers, and `held()`: what else the runtime keeps between steps, the pipeline's receive
    buffers; counted by storage) plus the most allocated above that during the step (cpu_counter)."""

    def __init__(self, device: torch.device, modules, optimizers, held=lambda: []):
        self.device, self.modules, self.optimizers, self.held = device, modules, optimizers, held
        self.bytes: int | None = None
        self.method = "torch.cuda.max_memory_allocated" if device.type == "cuda" else cpu_counter()[1]

    @contextlib.contextmanager
    def measure(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            yield
            torch.cuda.synchronize(self.device)
            self.bytes = int(torch.cuda.max_memory_allocated(self.device))
            return
        gc.collect()  # garbage of earlier steps (or plans) is not freed inside the measured step
        states = LiveTensorBytes()
        for m in self.modules:
            for t in [*m.parameters(), *m.buffers()]:
                states.track(t)
                if t.grad is not None:
                    states.track(t.grad)
        for opt in self.optimizers:
            for t in pytree.tree_leaves(opt.state_dict()["state"]):
                states.track(t)
        for t in self.held():
            states.track(t)
        counter, _ = cpu_counter()
        if isinstance(counter, LiveTensorBytes):  # counts the states itself
            counter, states = states, None
        with counter:
            yield
        self.bytes = counter.peak_bytes + (states.current_bytes if states is not None else 0)


def held_bytes(device: torch.device) -> int | None:
    """Bytes this rank holds between steps, to see whether they grow from step to step (memory
    that leaks: planner.compare.leak_note): what PyTorch's CUDA allocator has handed out on a GPU;
    on CPU the C heap in use once the collector has run over its young generations (the step's
    garbage; a full collection takes 0.2 s in a process with torch loaded), None where the C
    library does not say."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    if HEAP_READER is None:
        return None
    gc.collect(1)
    return HEAP_READER()


class MetricsLog:
    """--metrics FILE: rank 0 appends one JSON object a line as the run goes, flushed, so that a long
    run can be watched and plotted before (or without) its run.json: {"step", "loss", "lr",
    "grad_norm", "step_time_s", "tokens_per_s"} after each step, {"step", "validation_loss"} after
    each validation. A run resumed from a checkpoint appends to the file; a fresh one starts it."""

    def __init__(self, path: str | None, resumed: bool):
        self.fh = None
        if path and dist.get_rank() == 0:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self.fh = open(path, "a" if resumed else "w")

    def write(self, **record) -> None:
        if self.fh is not None:
            self.fh.write(json.dumps(record) + "\n")
            self.fh.flush()

    def close(self) -> None:
        if self.fh is not None:
            self.fh.close()


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
