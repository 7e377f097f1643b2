"""Pipeline parallelism: which model chunks a pipeline rank holds, and the schedule that runs them.

Chunk (stage) i of the plan lives on pipeline rank i % pp (torch.distributed.pipelining's
loop-style placement for interleaved schedules), or in a V under zbv (planner.plan.Plan.stage_rank,
torch's ScheduleZBVZeroBubble); a chunk is built from the whole model by keeping only its layer
range (runtime.model.Transformer(cfg, start, end)). Stage input and output shapes are inferred by
torch from the first micro-batch.
"""
from __future__ import annotations

import contextlib

import copy
from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleZBVZeroBubble)
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.pipelining._backward import stage_backward, stage_backward_input
from torch.distributed.pipelining._utils import _make_tensor_from_meta
from torch.distributed.pipelining.stage import to_local_if_dtensor

from planner.plan import Plan
from planner.sends import delivery_proofs
from runtime.documents import set_micro
from runtime.moe import uncounted


class _Stage(PipelineStage):
    """A PipelineStage that runs each micro-batch's backward as its chunk's ZeRO level says.

    torch.distributed.pipelining runs every micro-batch's backward without gradient sync and
    without resharding (stage.py, backward_maybe_with_nosync), and reduces all gradients after the
    last one: right for ZeRO 0 and 1. ZeRO-2 and 3 chunks reduce-scatter each micro-batch's
    gradients as they are produced and accumulate them sharded (the ZeRO paper's P_os+g and
    P_os+g+p, DeepSpeed's stages 2 and 3). A ZeRO-3 chunk also reshards after each block's
    backward, as after its forward (else it would hold every block gathered by the end of each
    backward: ZeRO-1's parameter memory); a ZeRO-2 chunk keeps its parameters gathered. The
    planner prices both so. Under zbv's split backward a ZeRO-2/3 chunk gathers its parameters
    before I and before W and reduce-scatters after W (_weight_backward). Under HSDP the replicas
    all-reduce a ZeRO-2/3 chunk's accumulated shard once, after the last micro-batch's backward.

    What torch would hold longer than a micro-batch needs, the stage lets go: receive buffers under
    pipeline.recv_buffers "in-flight" (allocated when posted, dropped after the backward), each
    loss's autograd graph (its leaf is the last stage's input) after the backward, the
    storage of a sent output once its gradient is back (torch's action runtime keeps every send
    to the end of the step), and, under that runtime, a sent input gradient once its receiver is
    known to have consumed it (_Sends). planner.memory.stage_recv_bytes prices what remains.

    The last stage's output, the logits, is freed once its loss is computed (_freeing_logits)."""

    def __init__(self, *args, zero: int = 0, recv_buffers: str = "preallocated", defer: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self._zero, self._defer = zero, defer
        self._in_flight = recv_buffers == "in-flight"
        self._losses: dict = {}
        self.sends: _Sends | None = None  # the rank's, under torch's action runtime (build_schedule)

    # torch's action runtime (interleaved, zbv) waits for its sends only at the end of the step, and
    # every micro-batch's input gradient would stay until then (planner.sends): the rank's _Sends
    # posts them instead (isend, as torch's _batch_p2p does for a batch of sends) and waits for
    # each once the receiver is known to have consumed it
    def get_bwd_send_ops(self, bwd_chunk_id):
        ops = super().get_bwd_send_ops(bwd_chunk_id)
        if self.sends is None:
            return ops
        self.sends.post((self.stage_index, bwd_chunk_id), ops)
        return []

    def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
        set_micro(self.submod, fwd_chunk_id)  # its dropout and document masks are the micro-batch's
        if self.sends is not None:
            self.sends.reached(("F", self.stage_index, fwd_chunk_id))
        return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def _forward_metadata_inference(self, *args, **kwargs):
        with uncounted():  # an MoE block's balancing loss of this forward is not the step's (runtime.moe)
            return super()._forward_metadata_inference(*args, **kwargs)

    # pipeline.recv_buffers "in-flight": a receive buffer is allocated when its transfer is posted
    # and dropped once its micro-batch's backward is done (what autograd still needs keeps its own
    # reference), where torch allocates one per micro-batch up front and holds them all step
    def _setup_forward_recv_info(self, num_microbatches, has_backward):
        if not self._in_flight:
            return super()._setup_forward_recv_info(num_microbatches, has_backward)
        super()._setup_forward_recv_info(1, has_backward)  # one micro-batch's infos, copied without buffers
        first = self.args_recv_info[0]
        for j in range(num_microbatches):
            self.args_recv_info[j] = tuple(_released(info) for info in first)

    def _create_grad_recv_info(self, act_send_info):
        infos = super()._create_grad_recv_info(act_send_info)
        return tuple(_released(info) for info in infos) if self._in_flight else infos

    def get_fwd_recv_ops(self, fwd_chunk_id):
        self._allocate(self.args_recv_info[fwd_chunk_id])
        return super().get_fwd_recv_ops(fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id):
        if self.has_backward and not self.is_last:
            self._allocate(self.grad_recv_info[bwd_chunk_id])
        return super().get_bwd_recv_ops(bwd_chunk_id)

    def set_local_bwd_input(self, next_stage_bwd_outputs, mb_index):
        # a gradient passed on the same rank (zbv) that is None zeroes the buffer it would have filled
        self._allocate([info for info, g in zip(self.grad_recv_info[mb_index], next_stage_bwd_outputs) if g is None])
        return super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)

    def backward_one_chunk(self, bwd_chunk_id, *args, **kwargs):
        if self.sends is not None:
            self.sends.reached(("B" if kwargs.get("full_backward", True) else "I", self.stage_index, bwd_chunk_id))
        sent = self._sent_outputs(bwd_chunk_id)
        result = super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
        for t in sent:
            # delivered: the next stage has sent this micro-batch's gradient back. Torch's action
            # runtime (interleaved, zbv) keeps its sends to the end of the step; their tensors then
            # hold no memory.
            t.untyped_storage().resize_(0)
        # the schedule keeps each micro-batch's loss to the end of the step, and with it the autograd
        # graph behind it, whose leaf is the stage's input: cut once the backward is done (under a
        # split backward, after W)
        loss = kwargs.get("loss")
        if isinstance(loss, torch.Tensor):
            if kwargs.get("full_backward", True):
                loss.detach_()
            else:
                self._losses[bwd_chunk_id] = loss  # detached after its W
        if self._in_flight:
            for info in (*self.args_recv_info.get(bwd_chunk_id, ()), *self.grad_recv_info.get(bwd_chunk_id, ())):
                _release(info)
        return result

    def backward_weight_one_chunk(self, bwd_chunk_id, *args, **kwargs):
        result = super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)
        loss = self._losses.pop(bwd_chunk_id, None)
        if loss is not None:
            loss.detach_()
        return result

    def _sent_outputs(self, chunk_id) -> list:
        """The tensors this stage sent another rank as micro-batch `chunk_id`'s output."""
        if self.is_last or self.stage_index_to_group_rank.get(self.stage_index + 1) == self.group_rank:
            return []
        outputs = self.fwd_cache.get(chunk_id, ((), None))[0]
        return [to_local_if_dtensor(t, detach=True) for t in outputs if isinstance(t, torch.Tensor)]

    def _allocate(self, infos):
        if self._in_flight:
            for info in infos:
                if info.buffer is None and info.tensor_meta is not None and not info.is_root_arg:
                    info.buffer = _make_tensor_from_meta(info.tensor_meta, self.device)

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs, last_backward=False):
        if self._zero not in (2, 3):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        if backward_type == "input":  # I (zbv): no weight gradient yet, nothing to reduce
            self._unshard()
            self.submod.set_is_last_backward(False)
            self.submod.set_requires_gradient_sync(False)
            self.submod.set_reshard_after_backward(self._zero == 3)  # each block after its I, as after F
            return stage_backward_input(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"],
                                        bwd_kwargs["input_values"], self.submod.parameters())
        if backward_type == "weight":
            return self._weight_backward(bwd_kwargs, last_backward)
        # the last micro-batch's backward ends FSDP2's backward: it releases its last reduce-scatter
        # input then, which it keeps between micro-batches
        self.submod.set_is_last_backward(last_backward)
        self.submod.set_reshard_after_backward(self._zero == 3)
        self.submod.set_requires_gradient_sync(last_backward or not self._defer)  # training.defer_grad_sync
        self.submod.set_requires_all_reduce(last_backward)  # HSDP: across the replicas once, at the end
        grads = stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"])
        return grads, None

    def _unshard(self):
        """Gather the chunk's parameters: torch's split backward finds the parameters to
        differentiate by asking the module for them (stage_backward_input and _weight take
        `submod.parameters()`), which must then be the gathered ones the forward used."""
        for m in self.submod.modules():
            if isinstance(m, FSDPModule):
                m.unshard()

    def _weight_backward(self, bwd_kwargs, last_backward):
        """W of a split backward (zbv): the micro-batch's weight gradients, then their reduce-scatter.
        torch differentiates with respect to the chunk's parameters as they are at W, which a ZeRO-3
        chunk has resharded since I (after a later micro-batch's forward): gather them again first,
        so that W reaches the parameters I's graph holds. The reduce-scatter is FSDP2's own
        post-backward, called by hand as torch's REDUCE_GRAD action calls it at the end of a step
        (PipelineStage.perform_reduce_grad): autograd's hooks fired at I, before W's gradients."""
        self._unshard()
        result = super().backward_maybe_with_nosync("weight", bwd_kwargs, last_backward)
        self.submod.set_requires_gradient_sync(True)
        self.submod.set_requires_all_reduce(last_backward)
        self.submod.set_reshard_after_backward(self._zero == 3)
        state = fully_shard.state(self.submod)
        for s in state._state_ctx.all_states:
            for group in s._fsdp_param_groups:
                group.post_backward()
        state._root_post_backward_final_callback()
        return result


class _Sends:
    """A pipeline rank's input-gradient sends under torch's action runtime, each waited for once
    the receiving rank is known to have consumed it (planner.sends.delivery_proofs over the
    schedule's own compute orders), the rest at the end of the step (finish). A wait for a consumed
    transfer returns at once."""

    def __init__(self, schedule, rank: int):
        orders = {r: [(a.computation_type.value, a.stage_index, a.microbatch_index) for a in actions if a is not None]
                  for r, actions in schedule.pipeline_order.items()}
        ranks = schedule.stage_index_to_group_rank
        self._proofs = delivery_proofs(orders, ranks.__getitem__, len(ranks))[rank]
        self._works: dict = {}  # (stage, micro-batch) -> works

    def post(self, key, ops) -> None:
        self._works[key] = [op.op(op.tensor, group=op.group, tag=op.tag, group_dst=op.group_peer) for op in ops]

    def reached(self, action) -> None:
        """`action` (kind, stage, micro-batch) starts: its input is consumed."""
        for key in self._proofs.get(action, ()):
            for work in self._works.pop(key, ()):
                work.wait()

    def finish(self) -> None:
        for works in self._works.values():
            for work in works:
                work.wait()
        self._works.clear()


def _release(info) -> None:
    """Drop a receive info's buffer (a stage's first inputs are the batch itself: none)."""
    if not info.is_root_arg:
        info.buffer = None


def _released(info):
    """A copy of a receive info without its buffer."""
    info = copy.copy(info)
    _release(info)
    return info


SCHEDULE_CLASSES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved-1f1b": ScheduleInterleaved1F1B,
                    "zbv": ScheduleZBVZeroBubble}


def build_schedule(plan: Plan, chunks: list[nn.Module], stage_ids: list[int], pp_group, device: torch.device,
                   loss_fn: Callable):
    """The torch.distributed.pipelining schedule of this pipeline rank. `loss_fn` returns the mean
    loss of one micro-batch; the schedule divides gradients by the number of micro-batches
    (scale_grads), so they are those of the mean over the rank's batch."""
    n_stages = len(plan.pipeline.stages)
    sharded = plan.mesh.grad_ranks > 1  # data parallelism wraps the chunks (dp x cp)
    stages = [_Stage(chunk, sid, n_stages, device, group=pp_group, zero=plan.pipeline.stages[sid].zero if sharded else 0,
                     recv_buffers=plan.pipeline.recv_buffers, defer=plan.training.defer_grad_sync)
              for chunk, sid in zip(chunks, stage_ids)]
    cls = SCHEDULE_CLASSES[plan.pipeline.schedule]
    loss_fn = _freeing_logits(loss_fn)
    if cls in (ScheduleInterleaved1F1B, ScheduleZBVZeroBubble):  # torch's action runtime
        schedule = cls(stages, n_microbatches=plan.pipeline.micro_batches, loss_fn=loss_fn, scale_grads=True)
        sends = _Sends(schedule, stages[0].group_rank)
        for stage in stages:
            stage.sends = sends
        return schedule
    return cls(stages[0], n_microbatches=plan.pipeline.micro_batches, loss_fn=loss_fn, scale_grads=True)


def _freeing_logits(loss_fn: Callable) -> Callable:
    """`loss_fn` that frees the logits' storage once it has their loss. torch keeps the last stage's
    output (the logits) in the stage's forward cache until the micro-batch's backward (all of them,
    under GPipe), and the schedules keep it in a local variable until the next forward on that stage
    returns (torch distributed/pipelining/schedules.py, _step_microbatches), beside the next
    micro-batch's logits. The loss keeps what its backward needs (runtime.loss: the gradient,
    computed in the forward; the schedule computes each loss right after its forward), and the
    head's backward reads its input and weight, not its output: the logits are dead once their loss
    is computed, as they are without a pipeline (runtime.train, Trainer._accumulate)."""
    def loss_then_free(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(logits, targets)
        to_local_if_dtensor(logits).untyped_storage().resize_(0)
        return loss
    return loss_then_free


def _stages_of(schedule) -> list:
    """The stages this rank runs: a multi-stage schedule's, or a single-stage schedule's one."""
    return getattr(schedule, "_stages", None) or [schedule._stage]


FORWARD_ACTIONS = ("F", "SEND_F", "RECV_F", "UNSHARD", "RESHARD")


@contextlib.contextmanager
def _forwards_only(schedule):
    """torch's action runtime (interleaved 1F1B, ZB-V) runs every action of its order in eval() too,
    backward ones included, which fail without a backward (torch 2.13): meanwhile each rank's order
    keeps its forwards, their transfers and FSDP's gathers, in the order they had."""
    order = getattr(schedule, "pipeline_order_with_comms", None)
    if not order:
        yield
        return
    schedule.pipeline_order_with_comms = {rank: [a for a in actions if a.computation_type.value in FORWARD_ACTIONS]
                                          for rank, actions in order.items()}
    try:
        yield
    finally:
        schedule.pipeline_order_with_comms = order


def run_schedule(schedule, stage_ids: list[int], n_stages: int, inputs: torch.Tensor, targets: torch.Tensor,
                 forward_only: bool = False) -> list:
    """One step through the pipeline (`forward_only`: its forwards and losses alone, under no_grad);
    returns the per-micro-batch losses (empty off the last stage)."""
    losses: list = []
    args = (inputs,) if 0 in stage_ids else ()
    kwargs = {"target": targets, "losses": losses} if n_stages - 1 in stage_ids else {}
    if forward_only:
        with _forwards_only(schedule):
            schedule.eval(*args, return_outputs=False, **kwargs)
    else:
        schedule.step(*args, return_outputs=False, **kwargs)
    sends = _stages_of(schedule)[0].sends
    if sends is not None:
        sends.finish()
    # detached: each loss would keep its micro-batch's autograd graph (nodes and records, which the
    # backward leaves behind) alive through the optimizer step; on CPU that is the device's memory,
    # 0.6 MiB at the optimizer step of tests/test_first_backward.py's pp2 1F1B plan, the tiny model's head stage
    return [loss.detach() for loss in losses]


def held_tensors(schedule) -> list[torch.Tensor]:
    """Tensors a schedule (None: no pipeline, none) keeps between steps: with pipeline.recv_buffers
    "preallocated" its stages' receive buffers, one per micro-batch
    for every input (activations) and output (gradients) received, allocated in the first step,
    and the gradients autograd accumulates into the activation buffers, which the next step frees
    (torch.distributed.pipelining's clear_runtime_states)."""
    if schedule is None:
        return []
    out = []
    for stage in _stages_of(schedule):
        for infos in [*stage.args_recv_info.values(), *stage.grad_recv_info.values()]:
            for info in infos:
                buf = getattr(info, "buffer", None)
                if isinstance(buf, torch.Tensor):
                    out += [buf] + ([buf.grad] if buf.grad is not None else [])
    return out
