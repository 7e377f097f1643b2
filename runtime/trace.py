"""`runtime.train --trace DIR`: one training step under torch.profiler, to see where a step's time goes.

The traced step is the last one (after the warm-up steps, so the optimizer state exists and the
allocator is warm). Each rank writes, under DIR, with STEM the plan file's stem:
- STEM-rankR.txt: torch.profiler's table of operators, sorted by their own time on the device
  (GPU kernels) where there is one, else by their own CPU time;
- STEM-rankR.trace.json.gz: the whole trace (chrome://tracing or ui.perfetto.dev read it gzipped).
and returns a summary for run.json: the step's wall time, the time the device spent in kernels
(the union of the kernels' intervals, NCCL's on their own stream included), the number of
operators the host dispatched and, on a GPU, the kernels' timeline (`kernel_timeline`: how many
kernels, and the idle gaps between them, short launch gaps apart from long waits on the host).
A device busy for much less than the step waited on the host: the step is bound by Python and
kernel launches, not by the GPU (the profiler slows the host, so the traced step is slower than
the others and its busy share lower).
"""
from __future__ import annotations

import contextlib
import gzip
import shutil
import time
from pathlib import Path

import torch


LONG_GAP_S = 100e-6  # an idle gap at least this long between kernels: the device waited on the host


def _kernel_spans(events) -> list:
    """(start, end) in microseconds of every GPU kernel among the profiler's events, sorted."""
    from torch.autograd import DeviceType
    return sorted((e.time_range.start, e.time_range.end) for e in events
                  if getattr(e, "device_type", None) == DeviceType.CUDA and getattr(e, "time_range", None))


def timeline(spans) -> dict:
    """Of kernel intervals (start, end) in microseconds, sorted by start: `busy_s`, the seconds in
    which at least one ran (their union; a sum over the operators would count each kernel under
    every parent), `kernels`, and the idle gaps between the first start and the last end, in
    seconds: `short_gaps_s` (each under LONG_GAP_S: the launch gaps between back-to-back kernels),
    `long_gaps_s` (the device waiting on the host: a synchronization, a host-bound stretch) and
    `gaps`, how many there were."""
    busy = short = long_ = 0.0
    gaps, end = 0, None
    for lo, hi in spans:
        if end is not None and lo > end:
            gap = (lo - end) / 1e6
            gaps += 1
            if gap < LONG_GAP_S:
                short += gap
            else:
                long_ += gap
        busy += max(0.0, hi - (lo if end is None else max(lo, end))) / 1e6
        end = hi if end is None else max(end, hi)
    return dict(busy_s=busy, kernels=len(spans), short_gaps_s=short, long_gaps_s=long_, gaps=gaps)


@contextlib.contextmanager
def traced_step(device: torch.device, out_dir: str, stem: str, rank: int, summary: dict):
    """Profile the body; fill `summary` once it ends (see the module doc)."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        yield
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - t0
    avgs = prof.key_averages()
    gpu = device.type == "cuda"
    sort = "self_device_time_total" if gpu else "self_cpu_time_total"
    base = out / f"{stem}-rank{rank}"
    Path(f"{base}.txt").write_text(avgs.table(sort_by=sort, row_limit=60) + "\n")
    raw = Path(f"{base}.trace.json")
    prof.export_chrome_trace(str(raw))
    with open(raw, "rb") as src, gzip.open(f"{raw}.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()
    # operators the host dispatched: every aten:: call, those an operator makes inside it included
    aten_calls = sum(a.count for a in avgs if a.key.startswith("aten::"))
    t = timeline(_kernel_spans(prof.events())) if gpu else {}
    summary.update(step_s=wall, device_kernel_s=t.pop("busy_s", None), aten_calls=aten_calls,
                   table=f"{base.name}.txt", trace=f"{raw.name}.gz", kernel_timeline=t or None)
