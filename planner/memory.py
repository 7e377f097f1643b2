"""What a runtime holds on a device beyond the ZeRO paper's accounting of parameters, gradients
and optimizer state (planner.cost): the buffers of the runtime's FSDP2 (planner.fsdp_memory) and
of its pipeline, and a rank's peak."""
from __future__ import annotations

import math

import numpy as np

from planner.fp8 import fp8_weight_bytes
from planner.fsdp_memory import forward_loss_bytes, fsdp_extra_parts, fsdp_groups, zero_state_bytes
from planner.model import ModelConfig
from planner.moe import ffn_width, largest_ffn_param
from planner.plan import DTYPES, Plan, split_backward
from planner.precision import (ADAM_STATE_BYTES, casts_weights, deferred_grad_bytes, keeps_shards, model_state_bytes,
                               sharded_param_bytes)
from planner.orders import peak_with_gradients
from planner.sends import unproven_sends


def first_backward_binds(schedule: str, pp: int, v: int, micro_batches: int, rank: int) -> bool:
    """Whether rank `rank` holds the most activations and gradients inside its stage's first
    backward of the step. The runtime frees the gradients after every step (runtime/train.py:
    zero_grad(set_to_none=True)), so a stage has none until its first backward, which creates them
    layer by layer as it frees that micro-batch's activations. With one stage a rank that
    moment is the peak where no forward follows it with as many micro-batches in flight: one
    micro-batch without a pipeline, GPipe, 1F1B on a rank whose forwards all come first
    (m <= p - rank). With more micro-batches a forward comes after every gradient exists, as the
    ZeRO paper counts them. A rank of several chunks (interleaved, ZB-V) is priced over its
    schedule instead (planner.orders.peak_with_gradients: a chunk's gradients from its first
    backward on)."""
    if v > 1:
        return False
    if pp == 1:
        return micro_batches == 1
    return schedule == "gpipe" or (schedule == "1f1b" and micro_batches <= pp - rank)


def first_backward_bytes(blocks, a_top, g_block, ends):
    """Most activations and gradients of one micro-batch a stage holds during its first backward
    (first_backward_binds), for any order of its layers: while layer l runs its backward, the
    layers before it keep their activations and the layers from l on have their gradients, so
    the worst order gives each other layer the larger of its two and layer l both: sum of
    max(a, g) plus the largest min(a, g). `blocks` blocks of at most `a_top` activation bytes
    (the largest mode the stage recomputes with) and `g_block` gradient bytes each, and `ends`
    [(activation, gradient bytes)] of its embedding and head. At most what the ZeRO paper's
    accounting gives only where a stage's blocks are alike: callers take the smaller. Scalars or
    numpy arrays."""
    most = np.where(np.asarray(blocks) > 0, np.minimum(a_top, g_block), 0.0)
    for a, g in ends:
        most = np.maximum(most, np.minimum(a, g))
    return blocks * np.maximum(a_top, g_block) + sum(np.maximum(a, g) for a, g in ends) + most


def first_backward_peak(held, act, grads, first):
    """Activations and gradients a rank whose peak falls in its stage's first backward
    (first_backward_binds) holds at that peak: `held` activations in flight, `act` of them the
    micro-batch that backward runs, beside the stage's `grads`, or the others beside what that
    backward holds at its worst (`first`, first_backward_bytes), whichever is less. Scalars or
    numpy arrays."""
    return np.minimum(held + grads, held - act + first)


# schedules torch.distributed.pipelining plays with its action runtime (_PipelineScheduleRuntime),
# which waits for its sends only at the end of the step: each send would keep its tensor to then,
# and the runtime waits for an input gradient's once its receiver has consumed it (planner.sends)
SENDS_HELD_TO_STEP_END = ("interleaved-1f1b", "zbv")


def stage_recv_bytes(mode: str, torch_p2p: bool, schedule: str, pp: int, i: int, last: int, micro_batches: int,
                     msg: float, together: bool = True) -> float:
    """Transfer buffers stage i of last + 1 holds (`msg` bytes each), as held all step.
    "preallocated": torch.distributed.pipelining's stage allocates, when the step starts, one
    input-activation buffer per micro-batch on every stage but the first and one output-gradient
    buffer per micro-batch on every stage but the last (torch distributed/pipelining/stage.py,
    _prepare_forward_infra / _prepare_backward_infra). "in-flight": each lives with its
    micro-batch (the input counted as its activation). `torch_p2p` (pipeline.sent_outputs "kept":
    torch.distributed.pipelining's transfers, the runtime's): in flight one of each kind beyond
    that (posted before its micro-batch's turn; measured on CPU), and where the schedule holds its
    sends to the end of the step (SENDS_HELD_TO_STEP_END, torch distributed/pipelining/schedules.py,
    _step_microbatches), the input gradients a stage has sent and not yet known delivered as well:
    at its rank's worst moment where `together` (every stage of the rank sends messages of one
    size), else its own most (planner.sends.unproven_sends: the runtime waits for each once its
    receiver has consumed it; an output's storage the runtime frees once its gradient is back,
    runtime.pipeline; ZB-V's two stages on one rank pass theirs directly). Megatron-LM ("freed")
    waits for each transfer as it goes."""
    if last == 0:
        return 0.0
    takes = i > 0 and not (schedule == "zbv" and i == pp)  # its input from another rank
    gives = i < last and not (schedule == "zbv" and i == pp - 1)  # its output to another rank
    sent = (unproven_sends(schedule, pp, (last + 1) // pp, micro_batches, together)[i]
            if (torch_p2p and schedule in SENDS_HELD_TO_STEP_END) else 0)
    received = ((i > 0) + (i < last)) * micro_batches if mode == "preallocated" else (takes + gives) * torch_p2p
    return (sent + received) * msg


def recv_buffer_bytes(plan: Plan, stage_ids) -> float:
    """Receive buffers the pipeline runtime holds on the rank of `stage_ids` (stage_recv_bytes)."""
    pipe, t, m = plan.pipeline, plan.training, plan.model
    msg = DTYPES[t.dtype] * plan.rank_micro_batch * t.seq_len * m.hidden
    msgs = {i: msg / (plan.mesh.tp if pipe.stages[i].sequence_parallel else 1) for i in stage_ids}
    together = len(set(msgs.values())) <= 1
    return sum(stage_recv_bytes(pipe.recv_buffers, pipe.sent_outputs == "kept", pipe.schedule, plan.mesh.pp, i,
                                len(pipe.stages) - 1, pipe.micro_batches, msgs[i], together) for i in stage_ids)


def stage_output_bytes(plan: Plan, i: int) -> float:
    """Bytes of stage i's output that torch.distributed.pipelining keeps per micro-batch from its
    forward to its backward (pipeline.sent_outputs "kept": PipelineStage.fwd_cache holds
    the output tuple, torch distributed/pipelining/stage.py forward_one_chunk; the runtime's last
    stage drops its logits, runtime.pipeline): beside the saved activations, which the block's
    output is not part of (the next block, on the next stage, saves it as its input)."""
    pipe, t, m = plan.pipeline, plan.training, plan.model
    if pipe.sent_outputs != "kept" or i == len(pipe.stages) - 1:
        return 0.0
    return (DTYPES[t.dtype] * plan.rank_micro_batch * t.seq_len * m.hidden
            / (plan.mesh.tp if pipe.stages[i].sequence_parallel else 1))


def document_mask_bytes(t, rows: float) -> float:
    """Bytes of the dense attention mask of a micro-batch of `rows` sequences under
    training.document_mask (runtime.documents): [rows, 1, s, s] in the compute dtype, built once a
    micro-batch on each stage with blocks and kept, as every block's attention saves it, until the
    micro-batch's backward on that stage ends."""
    return DTYPES[t.dtype] * rows * t.seq_len ** 2 if t.document_mask else 0.0


def stage_mask_bytes(plan: Plan, i: int) -> float:
    st = plan.pipeline.stages[i]
    blocks = any(plan.model.layer_kind(j) == "block" for j in range(st.start, st.end))
    return document_mask_bytes(plan.training, plan.rank_micro_batch) if blocks else 0.0


def largest_param_on_device(model: ModelConfig, index: int, tp: int) -> float:
    """Elements of the largest parameter tensor one TP rank holds for a layer (runtime/model.py's
    tensors: the vocabulary matrices, the position table, the projections)."""
    h = model.hidden
    if model.layer_kind(index) != "block":
        return max(math.ceil(model.vocab / tp) * h, model.seq_len * h if model.arch == "gpt" else 0)
    return max(h * max(model.q_dim, model.kv_dim) / tp, largest_ffn_param(model, tp))


def accumulation_bytes(model: ModelConfig, layers, tp: int, dp: int, micro_batches: int, gb: float) -> float:
    """Without data parallelism, autograd adds each micro-batch's gradient after the first to the
    accumulated one: a new gradient tensor at a time, at most the largest parameter of `layers` (a
    vocabulary matrix where the stage holds one). With data parallelism FSDP2 and replicate hold
    more than that already (fsdp_extra_parts; replicate's compute-dtype gradients)."""
    if dp > 1 or micro_batches <= 1:
        return 0.0
    return gb * max((largest_param_on_device(model, j, tp) for j in layers), default=0.0)


def tied_matrix_grad_bytes(model: ModelConfig, tp: int, gb: float, micro_batches: int) -> tuple[float, float]:
    """(through the backward, at its end): bytes of the tied matrix's gradients on a rank that
    holds both the embedding and a head tied to it (one parameter). The head's backward gives the
    matrix's first gradient, and autograd keeps it (the parameter's input buffer) until the
    embedding's backward, at the end of the backward, gives the second and adds the two into a
    third tensor, then into the accumulated gradient: three such tensors at once where gradients
    accumulate over micro-batches, two where the sum becomes the gradient. Measured on CPU
    (tests/test_loss.py)."""
    one = gb * math.ceil(model.vocab / tp) * model.hidden
    return one, one * (3 if micro_batches > 1 else 2)


def backward_flow_bytes(model: ModelConfig, t, tp: int, sp: bool, dp: int, micro_batch: int) -> float:
    """Bytes a backward holds for the block computing in it beyond the saved activations: the
    gradient of the block's output (the residual stream's, held through the block: float32 under
    autocast) beside the largest set of gradients the block's operations hold at one moment, and
    under sequence parallelism keeping shards (training.sp_saved_inputs "shard", runtime.sp_shard)
    one input gathered again for its linears' weight gradients, in the stream's dtype and, under
    autocast (float32 stream), its 16-bit cast beside it. Those moments, per token (autograd frees
    a saved tensor once the last node reading it has run; traced op by op on CPU, session 38 in
    docs/HISTORY.md):
    - the MLP's gate (SwiGLU): the output projection's input gradient and the two the product's
      backward makes from it, less the product it frees: 2 ffn/tp (GELU: its input gradient, ffn/tp);
    - the attention core's backward: the gradients of its output, Q, K and V, K and V as many
      heads as Q (grouped-query attention expands them): 4 q_dim/tp;
    - the block's input gradient: hidden, gathered whole under sequence parallelism.
    The weight-gradient temporary the output projection makes first (h ffn/tp) is the new
    accumulated gradient the caller adds (accumulation_bytes)."""
    e, tokens = DTYPES[t.dtype], micro_batch * t.seq_len
    elems = tokens * model.hidden
    stream = 4 if casts_weights(t, dp) else e
    mlp = (2 if model.arch == "llama" else 1) * ffn_width(model) / tp  # an MoE block's k rows a token
    flow = stream * elems + e * tokens * max(model.hidden, mlp, 4 * model.q_dim / tp)
    if keeps_shards(t, tp, sp):
        flow += (4 + e if casts_weights(t, dp) else e) * elems
    return flow


def held_i_to_w_bytes(model: ModelConfig, index: int, tp: int, tokens: float, e: float, replay_bytes: float,
                      recompute: str, sp: bool) -> float:
    """What layer `index` holds from its I to its W under a split backward (zbv): what its weight
    gradients start from (ModelConfig.weight_grad_inputs_per_token, for `tokens` tokens of e bytes)
    and, fully recomputed, its replay (runtime.recompute keeps it to W; a selective block's
    replayed attention core is read by I alone, a transient)."""
    return (e * tokens * model.weight_grad_inputs_per_token(index, tp, sp)
            + (replay_bytes if recompute == "full" else 0.0))


# What "other" holds at a rank's peak (memory_by_rank's other_parts, bytes; they add up to other):
# FSDP2's buffers held through the step and gathered for the layer computing, replicate's
# compute-dtype gradients, the pipeline's transfers (receive buffers, sends torch holds), a tied
# matrix's extra gradients, the loss's logits and float32 work, a block's replay, a new
# accumulated gradient and the activation gradients flowing back; FP8 weight copies kept for the
# step (planner.fp8.fp8_weight_bytes). (The optimizer step, torch's fused AdamW in place,
# allocates nothing: planner.precision.optimizer_step_bytes.)
OTHER_PARTS = dict.fromkeys(("fsdp_buffers", "fsdp_gathers", "replicated_gradients", "pipeline_receive_buffers",
                             "fp8_weight_copies",
                             "tied_embedding_gradients", "loss_logits", "recompute_replay", "gradient_accumulation",
                             "activation_gradients"), 0.0)


def memory_by_rank(plan: Plan, stage_info: list, rs_temp: bool = False) -> list[dict]:
    """Bytes each pipeline rank holds at its peak, by kind (planner.cost's memory model): the
    ZeRO paper's parameters, gradients and optimizer state by ZeRO level; the activations of the
    micro-batches in flight as the schedule holds them; and, as other, what FSDP2 holds beyond
    that (fsdp_extra_parts), replicate's compute-dtype gradients, the transient of the stage
    computing (replay, FSDP2 buffers), activation and logits gradients and the pipeline's receive
    buffers: the backward's peak, or on the head's rank the loss's forward where that holds more
    (its logits and float32 work beside FSDP2's buffers: the loss computes its gradient in the
    forward, runtime/loss.py, so a backward's replay never meets them). A rank holding a tied
    embedding and head can peak at the end of the backward instead (tied_matrix_grad_bytes); the
    optimizer step holds less than either (its fused AdamW allocates nothing). Where a rank peaks in its
    stage's first backward (first_backward_binds) its gradients grow as that backward frees the
    micro-batch's activations: the gradients shown are those beside every activation at the worst
    moment (first_backward_bytes), not all of them. A rank of several chunks holds a chunk's
    gradients from that chunk's first backward on: its activations and gradients are those of the
    moment where they add up to the most (planner.orders.peak_with_gradients). `stage_info`:
    per stage, its "params" and per-layer "costs" (planner.layers.LayerCost). Each rank's
    other_parts says what its other holds (OTHER_PARTS)."""
    m, t, mesh, pipe = plan.model, plan.training, plan.mesh, plan.pipeline
    # `dp` is the ranks ZeRO shards over: all of dp, or HSDP's shard group (at least 2, as dp is),
    # times cp (planner.mesh.Mesh.zero_shards)
    dp, tp, pp, v, mbs = mesh.zero_shards, mesh.tp, mesh.pp, pipe.virtual_stages, pipe.micro_batches
    e = DTYPES[t.dtype]
    pb, gb, ob = model_state_bytes(t, dp)
    spb = sharded_param_bytes(t)
    two = split_backward(pipe.schedule, pp)  # I and W apart (zbv)
    mem_by_rank = []
    for rr in range(pp):
        ids = plan.stages_of_rank(rr)
        # a micro-batch's stage output and document mask, held until its backward on the stage ends
        kept = {i: stage_output_bytes(plan, i) + stage_mask_bytes(plan, i) for i in ids}
        weights = {i: sum(c.activation_bytes for c in stage_info[i]["costs"]) + kept[i] for i in ids}
        zero = {i: 0.0 for i in range(len(pipe.stages))}
        split = None
        if two:
            tokens = plan.rank_micro_batch * t.seq_len  # held from each I to its W
            split = {**zero, **{i: sum(held_i_to_w_bytes(m, j, tp, tokens, e, c.replay_bytes, r,
                                                         pipe.stages[i].sequence_parallel)
                                       for j, c, r in zip(range(pipe.stages[i].start, pipe.stages[i].end),
                                                          stage_info[i]["costs"], pipe.stages[i].recompute))
                                for i in ids}}
        grads_of = dict(zero)  # each stage's gradients, which a rank of several chunks gains chunk by chunk
        p_bytes = g_bytes = o_bytes = other = fsdp_held = replicated = fp8_held = 0.0
        recv = recv_buffer_bytes(plan, ids)
        # of the stage computing in its backward, one at a time on a rank: its replay, FSDP2
        # buffers and accumulated gradient
        transient_parts = (0.0, 0.0, 0.0)
        fsdp_forward = 0.0  # what FSDP2 holds beside the loss's forward (the head's stage)
        first = first_backward_binds(pipe.schedule, pp, v, mbs, rr)  # then one stage: ids == [rr]
        first_bytes = 0.0
        for i in ids:
            si, st = stage_info[i], pipe.stages[i]
            # X of the P: experts spread by expert parallelism, sharded over dp / ep (planner.moe)
            P, X, dpx = si["params"], si.get("expert_params", 0.0), dp // mesh.ep
            shard = dp if dp > 1 else 1
            kinds = [m.layer_kind(j) for j in range(st.start, st.end)]
            block_params = [c.params for c, k in zip(si["costs"], kinds) if k == "block"]
            ends = {k: c.params for c, k in zip(si["costs"], kinds) if k != "block"}
            root_params, own = fsdp_groups(m.tie_embeddings, ends.get("embedding"), ends.get("head"))
            deferred = dict(defer=t.defer_grad_sync, deferred_gb=deferred_grad_bytes(t))
            ps, gs, os_ = zero_state_bytes(st.zero, dp, mbs, pb, gb, ob, spb, **deferred)
            xs = zero_state_bytes(st.zero, dpx, mbs, pb, gb, ob, spb, fsdp=True, **deferred)
            p_bytes, g_bytes = p_bytes + (P - X) * ps + X * xs[0], g_bytes + (P - X) * gs + X * xs[1]
            o_bytes += (P - X) * os_ + X * xs[2]
            grads_of[i] = (P - X) * gs + X * xs[1]
            if st.zero == 3 and spb == 0 and ob > ADAM_STATE_BYTES:
                # FSDP2's float32 shard is both the parameters and the master copy: shown as parameters
                master = ob - ADAM_STATE_BYTES
                moved = (P - X) * master / shard * (shard > 1) + X * master / dpx  # X: FSDP2's, dpx >= 1
                p_bytes, o_bytes = p_bytes + moved, o_bytes - moved
            held, transient = fsdp_extra_parts(st.zero, dp, mbs, block_params, root_params, pb, gb, spb,
                                               two, rs_temp, own, head_held=v > 1,
                                               resharded=pp == 1 and mbs == 1, defer=t.defer_grad_sync)
            if first:
                block_acts = [c.activation_bytes for c, k in zip(si["costs"], kinds) if k == "block"]
                first_bytes = float(first_backward_bytes(
                    len(block_acts), max(block_acts, default=0.0), (block_params or [0.0])[0] * gs,
                    [(c.activation_bytes, c.params * gs) for c, k in zip(si["costs"], kinds) if k != "block"])
                ) + kept[i]
            fsdp_held += held
            fp8_held += fp8_weight_bytes(t, sum(block_params))
            # replaying one block's forward (under a split backward a full one's replay is held to W: above)
            stage_replay = max((c.replay_bytes for c, r in zip(si["costs"], st.recompute)
                                if not (two and r == "full")), default=0.0)
            acc = accumulation_bytes(m, range(st.start, st.end), tp, dp, mbs, gb)
            if stage_replay + transient + acc > sum(transient_parts):
                transient_parts = (stage_replay, transient, acc)
            fsdp_forward = max(fsdp_forward, forward_loss_bytes(st.zero, dp, own[1], pb, v > 1))
            if st.zero == 0 and dp > 1:
                # replicate (FSDP2) holds the gradients autograd produces, in the parameters' compute
                # dtype, beside the ones it all-reduces and accumulates in the gradients' dtype
                replicated += P * pb
        held_other, transient_bytes = fsdp_held + replicated + recv + fp8_held, sum(transient_parts)
        act_grad = backward_flow_bytes(m, t, tp, any(pipe.stages[i].sequence_parallel for i in ids), dp, plan.rank_micro_batch)
        head_logits, tied, tied_end = 0.0, 0.0, 0.0
        if any(pipe.stages[i].end == m.num_layers_total for i in ids):  # the loss's logits
            head_logits = m.loss_bytes(plan.rank_micro_batch, t.seq_len, tp, e)[1]
            if m.tie_embeddings and any(pipe.stages[i].start == 0 and pipe.stages[i].end == m.num_layers_total
                                        for i in ids):  # one matrix, two gradients (a pipeline's head: a copy)
                tied, tied_end = tied_matrix_grad_bytes(m, tp, gb, mbs)
        # the loss's logits and float32 work run in the head's forward (runtime/loss.py), a block's
        # replay, a new accumulated gradient and the activation gradients in a backward: one
        # operation at a time on a rank, so the two never add up
        forward = head_logits + fsdp_forward if head_logits else 0.0
        other = held_other + tied + max(forward, transient_bytes + act_grad)
        acts, grads_held = peak_with_gradients(pipe.schedule, pp, v, mbs, rr, {**zero, **weights}, split,
                                               grads_of if v > 1 else None)
        grads = g_bytes
        if first:  # the gradients beside every activation at the first backward's worst moment
            grads = float(first_backward_peak(acts, weights[ids[0]], g_bytes, first_bytes)) - acts
        elif v > 1:  # a rank's chunks: those whose first backward has begun, at the worst moment
            grads = grads_held
        held_parts = dict(OTHER_PARTS, fsdp_buffers=fsdp_held, replicated_gradients=replicated,
                          pipeline_receive_buffers=recv, fp8_weight_copies=fp8_held)
        if forward > transient_bytes + act_grad:
            moment = dict(loss_logits=head_logits, fsdp_gathers=fsdp_forward)
        else:
            moment = dict(zip(("recompute_replay", "fsdp_gathers", "gradient_accumulation"), transient_parts),
                          activation_gradients=act_grad)
        peak = dict(parameters_bytes=p_bytes, gradients_bytes=grads, optimizer_bytes=o_bytes,
                    activations_bytes=acts, other_bytes=other, peak_at="backward")
        parts = dict(held_parts, tied_embedding_gradients=tied, **moment)
        end = held_other + act_grad + tied_end  # a tied matrix's two gradients meet
        if tied and g_bytes + end > grads + acts + other:
            peak.update(gradients_bytes=g_bytes, activations_bytes=0.0, other_bytes=end, peak_at="end of backward")
            parts = dict(held_parts, activation_gradients=act_grad, tied_embedding_gradients=tied_end)
        total = sum(v for k, v in peak.items() if k != "peak_at")
        mem_by_rank.append(dict(pp_rank=rr, **peak, total_bytes=total, other_parts=parts))
    return mem_by_rank
