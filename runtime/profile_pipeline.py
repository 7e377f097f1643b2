"""The pipeline part of `runtime.profile model`: torch.distributed.pipelining's overhead per
operation at the model's own scale (planner.model_profile's `pipeline`)."""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from runtime.device import current, scalar, sync
from runtime.profile_model import _amp


def measure_pipeline(world: int, cluster, repeats: int, cfg, seq: int, block_s: tuple, m: int = 8,
                     dtype: str = "fp32") -> dict:
    """Overhead per pipeline operation of torch.distributed.pipelining here, at the model's own
    scale: two-rank pipelines (all rank pairs at once) of one of the model's blocks per stage, on
    [1, seq, hidden] micro-batches, run GPipe, 1F1B and interleaved 1F1B (two stages per rank) over
    m micro-batches; the overhead is the per-operation time that makes the planner's schedule
    simulator (with `block_s`, the block's measured forward and backward at micro-batch 1, and the
    cluster profile's send/recv and compute sharing) reproduce the measured step."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
    from planner.schedule import Sharing, StageTimes, simulate
    from runtime.model import Transformer, init_weights
    dev = current()
    mesh = DeviceMesh(dev.type, torch.arange(world).reshape(world // 2, 2), mesh_dim_names=("dp", "pp"))
    me = mesh["pp"].get_local_rank()
    msg = 4 * seq * cfg.hidden
    send = cluster.p2p_time(msg, 0, 1)
    sharing = Sharing.of(cluster.compute_slots, world, world // 2, world)
    out = {"pp": 2, "micro_batches": m, "message_bytes": msg, "layer": "block", "block_s": list(block_s)}
    for name, cls, v in (("gpipe", ScheduleGPipe, 1), ("1f1b", Schedule1F1B, 1),
                         ("interleaved-1f1b", ScheduleInterleaved1F1B, 2)):
        stages = []
        for i in range(v):
            with torch.device("meta"):
                block = Transformer(cfg, 1, 2)
            block.to_empty(device=dev)
            init_weights(block, me + 2 * i)
            stages.append(PipelineStage(block, me + 2 * i, 2 * v, dev, group=mesh["pp"].get_group()))
        sched = cls(stages if v > 1 else stages[0], n_microbatches=m, loss_fn=lambda y, t: ((y - t) ** 2).mean(),
                    scale_grads=True)
        g = torch.Generator().manual_seed(0)
        x, t = (torch.randn(m, seq, cfg.hidden, generator=g).to(dev) for _ in range(2))
        times = []
        for i in range(repeats + 2):
            dist.barrier()
            t0 = time.perf_counter()
            with _amp(dtype):
                sched.step(x) if me == 0 else sched.step(target=t, losses=[])
            sync()
            dist.barrier(group=mesh["pp"].get_group())
            if i >= 2:
                times.append(time.perf_counter() - t0)
        vals = scalar(statistics.median(times))
        dist.all_reduce(vals, op=dist.ReduceOp.MAX)
        measured = float(vals)

        def played(o):
            st = [StageTimes(block_s[0] + o, block_s[1] + o, send_fwd_s=send, send_bwd_s=send) for _ in range(2 * v)]
            return simulate(name, 2, v, m, st, sharing=sharing).step_time_s
        base, slope = played(0.0), (played(1e-3) - played(0.0)) / 1e-3
        out[name] = {"step_s": measured, "overhead_per_op_s": max(0.0, (measured - base) / slope)}
    return out
