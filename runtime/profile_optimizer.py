"""The model profiler's timing of the optimizer step (runtime.profile_model): the runtime's gradient
clipping and AdamW on a layer's parameters, streamed from memory as a whole model's step streams
them, and how many passes a timed sample needs on a shared host."""
from __future__ import annotations

import math
import os
import statistics
import time

import torch
import torch.distributed as dist

from runtime.device import current, scalar, sync

MIN_SAMPLE_S = 0.02  # a timed sample spans several scheduler time slices
STREAM_COPIES_MAX = 64  # copies of a layer's parameters the optimizer's timing streams through at most
DTENSOR_COPIES_PER_CALL = 8  # of DTensor copies, as many in one call of AdamW's kernels (time_optimizer)


def passes_per_sample(seconds: float) -> int:
    """Back-to-back repetitions per timed sample, the same on every rank: processes that share
    cores are preempted every few milliseconds, so a single short pass times either a full core
    or a wait; a sample of several slices times the sustained share each process gets."""
    k = scalar(max(1, math.ceil(MIN_SAMPLE_S / max(seconds, 1e-6))), dtype=torch.int64)
    dist.all_reduce(k, op=dist.ReduceOp.MAX)
    return int(k)


def stream_copies(params) -> tuple[list, int]:
    """`params` and n - 1 copies of them (their gradients too), n such that the optimizer states
    of this host's ranks come to twice the device's last-level cache (a CPU's is shared by the
    host's processes), and how many that is (n). A step updates every layer in turn, so each
    layer's states come from memory; timed alone, a layer's stay in the cache (this machine,
    one core, AdamW on parameters of the tiny model's block shapes: one block 0.34 ms, four 2.5
    ms)."""
    from torch.distributed.tensor import DTensor
    from runtime.device import last_level_cache_bytes
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params)
    sharing = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if current().type == "cpu" else 1
    state = 4 * local * 4 * sharing  # float32 weights, gradients and AdamW's two moments
    n = max(1, min(STREAM_COPIES_MAX, math.ceil(2 * last_level_cache_bytes(current()) / max(state, 1))))
    out = list(params)
    for _ in range(n - 1):
        for p in params:
            q = torch.nn.Parameter(p.detach().clone())
            q.grad = p.grad.detach().clone() if p.grad is not None else None
            out.append(q)
    return out, n


def call_groups(params: list, per_copy: int, dtensors: bool) -> list[dict]:
    """AdamW's parameter groups (one call of its kernels each) over `params`, copies of `per_copy`
    parameters in a row: DTENSOR_COPIES_PER_CALL copies a group when they are DTensors, else one."""
    size = per_copy * DTENSOR_COPIES_PER_CALL if dtensors else len(params)
    return [{"params": params[i:i + size]} for i in range(0, len(params), max(size, 1))]


def time_optimizer(params, repeats) -> float:
    """Seconds of the runtime's gradient clipping (its local work) and AdamW step on `params`, per
    copy of them streamed through memory (stream_copies). DTensor copies go 8 to a call: DTensor's
    first call over a list propagates shardings at ~20 ms a DTensor (foreach AdamW, session 37: 64
    copies of a block took 13.5 s, then 0.14 s a step, 6 of `make demo`'s 8.6 min); groups of 8
    timed the TP-2 and ZeRO-3 blocks at 0.93-1.27x one list (docs/HISTORY.md, session 37)."""
    from torch.distributed.tensor import DTensor
    from runtime.optim import clip_grad_norm, reduce_partial_grads
    reduce_partial_grads(params, reduce=False)  # its all-reduce: once per step, priced by planner.cost
    per_copy, dtensors = len(params), any(isinstance(p, DTensor) for p in params)
    params, n = stream_copies(params)
    groups = call_groups(params, per_copy, dtensors)
    opt = torch.optim.AdamW(groups, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)  # the runtime's

    def one():
        sync()
        t0 = time.perf_counter()
        clip_grad_norm(params, 1.0, None, current(), reduce=False)  # its collectives: once per step
        opt.step()
        sync()
        return time.perf_counter() - t0

    one()
    k = passes_per_sample(one())
    times = []
    for _ in range(repeats):
        dist.barrier()
        times.append(sum(one() for _ in range(k)) / k)
    return statistics.median(times) / n
