"""Pipeline parallelism: which model chunks a pipeline rank holds, and the schedule that runs them.

Chunk (stage) i of the plan lives on pipeline rank i % pp (torch.distributed.pipelining's
loop-style placement for interleaved schedules); a chunk is built from the whole model by
keeping only its layer range (runtime.model.Transformer(cfg, start, end)). Stage input and
output shapes are inferred by torch from the first micro-batch.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.pipelining._backward import stage_backward

from planner.plan import Plan

class _Stage(PipelineStage):
    """A PipelineStage whose ZeRO-3 chunk frees each block's gathered parameters after the block's
    backward, as it does after its forward.

    torch.distributed.pipelining turns FSDP2's reshard-after-backward off for every micro-batch's
    backward (stage.py, backward_maybe_with_nosync: no gradient sync, no reshard), so a ZeRO-3
    chunk would hold every block unsharded by the end of each backward: ZeRO-1's parameter
    memory. A ZeRO-3 stage of a plan promises sharded parameters outside the blocks in use, so
    this stage runs the same backward with resharding on; gradients still accumulate unsharded
    until the step's last backward, and each micro-batch's forward and backward gather the
    parameters again, as the planner prices them."""

    def __init__(self, *args, reshard_after_backward: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self._reshard = reshard_after_backward

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs, last_backward=False):
        if not self._reshard or backward_type != "full":
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        self.submod.set_is_last_backward(False)
        self.submod.set_reshard_after_backward(True)
        self.submod.set_requires_gradient_sync(False)
        grads = stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"])
        return grads, None


SCHEDULE_CLASSES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved-1f1b": ScheduleInterleaved1F1B}


def build_schedule(plan: Plan, chunks: list[nn.Module], stage_ids: list[int], pp_group, device: torch.device,
                   loss_fn: Callable):
    """The torch.distributed.pipelining schedule of this pipeline rank. `loss_fn` returns the mean
    loss of one micro-batch; the schedule divides gradients by the number of micro-batches
    (scale_grads), so they are those of the mean over the rank's batch."""
    n_stages = len(plan.pipeline.stages)
    zero3 = plan.mesh.dp > 1
    stages = [_Stage(chunk, sid, n_stages, device, group=pp_group,
                     reshard_after_backward=zero3 and plan.pipeline.stages[sid].zero == 3)
              for chunk, sid in zip(chunks, stage_ids)]
    cls = SCHEDULE_CLASSES[plan.pipeline.schedule]
    if cls is ScheduleInterleaved1F1B:
        return cls(stages, n_microbatches=plan.pipeline.micro_batches, loss_fn=loss_fn, scale_grads=True)
    return cls(stages[0], n_microbatches=plan.pipeline.micro_batches, loss_fn=loss_fn, scale_grads=True)


def run_schedule(schedule, stage_ids: list[int], n_stages: int, inputs: torch.Tensor, targets: torch.Tensor) -> list:
    """One step through the pipeline; returns the per-micro-batch losses (empty off the last stage)."""
    losses: list = []
    args = (inputs,) if 0 in stage_ids else ()
    kwargs = {"target": targets, "losses": losses} if n_stages - 1 in stage_ids else {}
    schedule.step(*args, return_outputs=False, **kwargs)
    return losses
