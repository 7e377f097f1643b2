"""One layer on one device, one micro-batch: its time (matrix products by roofline, fused
attention at its measured rate, memory-bound operations, TP communication, recomputation, the
autocast casts and gradient accumulation), the activations it keeps, what its replay holds, and
the parameters it holds; planner.cost adds the layers of a stage up and plays the schedule (its
module doc gives the sources). With a measured model profile the layer's figures come from
planner.model_profile.profiled_layer_cost instead."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from planner.cluster import ClusterSpec
from planner.comm import ASYNC_TP_HIDDEN, cp_comm, overlapped_sp_comm, regathers, tp_comm
from planner.fp8 import (fp8_cast_times, fp8_gemm_time, fp8_rate, gathered_act_bytes, is_fp8_product,
                         saved_input_bytes_less)
from planner.model import ModelConfig
from planner.moe import dispatch_bytes, expert_load_costs, expert_parallel_comm, ffn_params, held_experts
from planner.plan import DTYPES, Plan, Stage, split_backward
from planner.pointwise import pointwise_seconds
from planner.precision import GRAD_ACCUMULATION_BYTES, autocast_cast_bytes, casts_weights, runtime_held_bytes
from planner.sac import kept_bytes, replayed_products


@dataclass
class LayerCost:
    """One layer on one device, one micro-batch."""
    fwd_compute_s: float
    bwd_compute_s: float  # includes recomputation
    fwd_tp_s: float
    bwd_tp_s: float  # includes recomputed forward's TP communication
    activation_bytes: float  # kept from forward to backward
    replay_bytes: float  # extra held while this layer is recomputed and back-propagated
    params: float  # parameters this device holds for the layer
    optimizer_s: float = 0.0  # measured optimizer step on the layer's parameters (model profile only)
    dp_measured: dict | None = None  # measured data-parallel extras of the layer (model profile only)
    bwd_weight_s: float = 0.0  # the part of bwd_compute_s that computes weight gradients (see layer_cost)
    fwd_cp_s: float = 0.0  # context-parallel K/V all-gather (planner.comm.cp_comm)
    bwd_cp_s: float = 0.0  # its gradients' reduce-scatter, and the all-gather again where recomputed
    fwd_ep_s: float = 0.0  # expert parallelism's all-to-alls (planner.moe.expert_parallel_comm)
    bwd_ep_s: float = 0.0
    expert_params: float = 0.0  # of `params`, the experts spread over the EP group (mesh.ep > 1), else 0



# ------------------------------------------------------------------ per-layer traffic
def gemm_time(count: int, M: int, N: int, K: int, e: int, rate, bw: float) -> float:
    """Roofline time of `count` (M x K) @ (K x N) products (Williams et al., Roofline, 2009):
    the slower of their FLOPs at the matmul rate and their bytes at the memory bandwidth. `rate`
    is FLOP/s, or a function (M, N, K) -> FLOP/s for devices whose rate depends on the size
    (planner.cluster.DeviceSpec.gemm_flops_per_s); a batched call is sized by its total FLOPs,
    as one product `count` times as tall."""
    r = rate(count * M, N, K) if callable(rate) else rate
    return count * max(2.0 * M * N * K / r, e * (M * K + K * N + M * N) / bw)


def attention_core_hw_flops(model: ModelConfig, b: int, s: int, attention: str,
                            masked: bool = False) -> tuple[float, float]:
    """(forward, backward) FLOPs the attention core really executes on one whole layer. `masked`:
    under an explicit mask (training.document_mask) a fused kernel computes every block of the
    scores, where with the causal flag alone it skips those above the diagonal."""
    core = model.attention_core_flops(b, s)
    if attention != "unfused":  # fused: the causal half, the backward recomputing the scores
        half = 1.0 if masked else 0.5
        return half * core, half * core * 2.5
    return core, 2.0 * core


def repeated_kv_bytes(m: ModelConfig, t, b: float, s: int, tp: int, e: int) -> tuple[float, float]:
    """(bytes moved, bytes kept beyond K and V) per block where the runtime repeats grouped K and V
    heads to the query heads (runtime.documents: torch's fused kernels take an explicit mask with
    grouped-query attention only by falling back to the math kernel, which materializes the
    scores): one copy kernel a pass (the backward's sums the same bytes), and the attention
    kernel keeps the repeated heads for its backward instead of the grouped ones."""
    if not t.document_mask or m.kv_dim == m.q_dim:
        return 0.0, 0.0
    return 2.0 * e * b * s * (m.q_dim + m.kv_dim) / tp, 2.0 * e * b * s * (m.q_dim - m.kv_dim) / tp


def layer_cost(plan: Plan, cluster: ClusterSpec, index: int, stage: Stage, tp_ranks: list,
               model_profile=None, dp_extras: bool = True) -> LayerCost:
    if model_profile is not None:  # measured layers (planner.model_profile)
        from planner.model_profile import profiled_layer_cost
        return profiled_layer_cost(plan, cluster, index, stage, tp_ranks, model_profile, dp_extras)
    m, t = plan.model, plan.training
    # under context parallelism a rank computes 1 / cp of each sequence's tokens: a fraction of a
    # sequence's linear layers, its queries' rows of the attention (against all keys: 1 / cp of it)
    cp = plan.mesh.cp
    b, s, tp, sp = t.micro_batch / cp, t.seq_len, plan.mesh.tp, stage.sequence_parallel
    e, dropout, kind, rec = DTYPES[t.dtype], t.dropout > 0, m.layer_kind(index), stage.recompute[index - stage.start]
    # fused attention (not a library GEMM), at its rate for this sequence length and head size
    rate = (cluster.device.attention_flops_per_s(t.dtype, s, m.dim_per_head, cluster.device.attention_kernel(t))
            if t.attention != "unfused" else None)
    grate = lambda M, N, K: cluster.device.gemm_flops_per_s(t.dtype, M, N, K)  # noqa: E731
    bw = cluster.device.memory_bytes_per_s
    wgrad = 0.0  # weight-gradient GEMMs: one per forward product, of its FLOPs (zbv runs them apart)
    fp8_f = fp8_b = 0.0  # FP8 operands' casts (planner.fp8)
    if kind == "block":
        gemms = m.block_gemms(b, s, tp)
        # the linear products, on FP8 tensor cores under training.fp8 with their operands' casts (planner.fp8)
        rate8 = fp8_rate(cluster.device) if t.fp8 else None
        product_s = lambda g: (fp8_gemm_time(g, rate8, bw) if t.fp8 and is_fp8_product(m, g)  # noqa: E731
                               else gemm_time(*g, e, grate, bw))
        linear_s = [product_s(g) for g in gemms[:-2]]
        if t.fp8:
            fp8_f, fp8_b = fp8_cast_times(m, t, gemms[:-2], cluster.device, plan.pipeline.micro_batches)
        dense = wgrad = sum(linear_s)
        if t.attention != "unfused":
            core_f, core_b = (f / tp / rate for f in attention_core_hw_flops(m, b, s, t.attention, t.document_mask))
        else:
            core_f = sum(gemm_time(*g, e, grate, bw) for g in gemms[-2:])
            core_b = 2 * core_f
        mm_f, mm_b = dense + core_f, 2 * dense + core_b
    elif kind == "head":
        mm_f = wgrad = gemm_time(1, b * s, math.ceil(m.vocab / tp), m.hidden, e, grate, bw)
        mm_b = 2 * mm_f
    else:
        mm_f = mm_b = 0.0
    dp = plan.mesh.grad_ranks  # without data parallelism (dp x cp = 1) the runtime computes by autocast on float32 weights
    attn_drop = t.attention_dropout_p > 0
    el_f, el_b = pointwise_seconds(cluster.device, t.elementwise_kernels, m, index, b, s, tp, sp, e, dropout,
                                   t.attention, autocast=casts_weights(t, dp), attention_dropout=attn_drop,
                                   draws=(tp if sp else 1) * cp)
    ops = rec == "selective" and t.selective_recompute == "ops"  # torchtitan's per-op policy (planner.sac)
    # kept shards gathered anew (not where the replay gathers them)
    again = regathers(t, "full" if ops else rec, split_backward(plan.pipeline.schedule, plan.mesh.pp))
    act_bytes = e * b * s * m.hidden
    gather_bytes = gathered_act_bytes(m, t, kind, act_bytes, e)  # 8-bit under FP8 linears
    tp_f, tp_b = tp_comm(cluster, kind, act_bytes, sp, tp_ranks, b, s, again, gather_bytes)
    if t.tp_comm_overlap and sp and kind == "block" and m.moe is None:  # beside the linears' GEMMs
        tp_f, tp_b = overlapped_sp_comm(cluster, act_bytes, gather_bytes, tp_ranks, linear_s, again)
    if t.async_tp_allreduce and tp > 1 and not sp and kind in ("block", "head"):
        # each column-parallel linear's input-gradient all-reduce runs beside its weight-gradient
        # GEMM, (in x tokens) @ (tokens x out): QKV and the first MLP projection in a block, the
        # head; the GEMM hides ASYNC_TP_HIDDEN of the time they share
        wg = lambda c, M, N, K: gemm_time(c, K, N, M, e, grate, bw)  # noqa: E731
        if kind == "block":
            ar = tp_b / 2
            tp_b = sum(ar - ASYNC_TP_HIDDEN * min(ar, linear_s[i] if t.fp8 else wg(*gemms[i])) for i in (0, 2))
        else:
            tp_b -= ASYNC_TP_HIDDEN * min(tp_b, wg(1, b * s, math.ceil(m.vocab / tp), m.hidden))
    params = layer_params_on_device(m, index, tp)
    experts = held_experts(m, kind, tp, plan.mesh.ep)  # the rank's share where spread by expert parallelism
    params -= experts * (plan.mesh.ep - 1)
    # the weights of its matrix products, which the runtime's autocast casts (precision), the casts
    # of their gradients (upcasts) in the weights' share of the backward; none in an embedding
    mats = params - replicated_params(m, kind, matrices=False) if kind != "embedding" else 0.0
    cf, cb = (x * mats for x in autocast_cast_bytes(t, dp))
    cast_f, cast_b = cluster.device.pointwise_seconds(cf), cluster.device.pointwise_seconds(cb, upcast=cb)
    accumulate = cast_b + (GRAD_ACCUMULATION_BYTES[t.grad_accumulation] * params / bw
                           if plan.pipeline.micro_batches > 1 else 0.0)
    moved, repeated = repeated_kv_bytes(m, t, b, s, tp, e) if kind == "block" else (0.0, 0.0)
    repeat_s = cluster.device.pointwise_seconds(moved)  # a copy forward, its sum backward
    # an MoE block's busiest EP rank computes more rows than the mean (training.moe_load_factor)
    load_f, load_b, load_w, load_kept = expert_load_costs(plan, kind, b, s, e, lambda *g: gemm_time(*g, e, grate, bw),
                                                          cluster.device.pointwise_seconds)
    if kind == "block" and t.elementwise_kernels == "eager":
        # the runtime's expert-parallel exchange: its local copies, the sums it gets back kept
        # (planner.moe.dispatch_bytes), and each expert's weight gradients scaled by 1 / ep, a pass
        # over them (runtime.moe); fused kernels price a framework's exchange, as its permutation
        # (planner.pointwise.fused_bytes)
        moved_f, moved_b, kept = (b * s * x for x in dispatch_bytes(m, e, plan.mesh.ep))
        scaled = cluster.device.pointwise_seconds(2 * e * experts)
        load_f += cluster.device.pointwise_seconds(moved_f)
        load_b += cluster.device.pointwise_seconds(moved_b) + scaled
        load_w += scaled
        load_kept += kept
    fwd_c = mm_f + el_f + cast_f + repeat_s + load_f + fp8_f
    bwd_c = mm_b + el_b + accumulate + repeat_s + load_b + fp8_b
    # the weights' share of the backward: their GEMMs and adding them up; an embedding's whole
    # backward is its weight's gradient. Recomputation replays for the input gradients.
    wgrad = (el_b if kind == "embedding" else wgrad) + accumulate + load_w
    if rec == "full":
        bwd_c += fwd_c
        tp_b += tp_f
    elif ops:  # the forward replayed but its saved products and attention; its collectives but reduce-scatters
        bwd_c += sum(product_s(g) for g in replayed_products(m, b * s, tp)) + fwd_c - mm_f
        tp_b += (2 * cluster.collective_time("all_gather", gather_bytes, tp_ranks) if sp and tp > 1 else tp_f)
    elif rec == "selective":
        if t.attention == "unfused":
            core = sum(gemm_time(*g, e, grate, bw) for g in m.block_gemms(b, s, tp)[-2:])
            core += (4 * e + 1 if attn_drop else 2 * e) * m.heads * s * s * b / tp / bw
        else:
            core = attention_core_hw_flops(m, b, s, t.attention, t.document_mask)[0] / tp / rate
        bwd_c += core
    kw = dict(micro_batch=b, seq_len=s, tp=tp, sequence_parallel=sp, bytes_per_element=e,
              dropout=dropout, attention=t.attention, attention_dropout=attn_drop,
              fused_swiglu=t.elementwise_kernels != "eager")
    held = [runtime_held_bytes(m, t, dp, index, r, b, s, tp, sp, mats, cluster.backend == "gloo",
                               replay=rec == "full" and r != rec) for r in (rec, "none")]
    cp_f, cp_b, gathered = context_parallel_parts(plan, cluster, index, rec, tp_ranks)
    fp8_less = saved_input_bytes_less(m, t, b, s, tp, sp, e) if kind == "block" else 0.0  # 8-bit saved inputs
    act = (kept_bytes(m, b, s, tp, sp, e) if ops else m.activation_bytes(index, recompute=rec, **kw)) + held[0]
    act += gathered + repeated if rec == "none" else 0.0
    act += load_kept - fp8_less if rec != "full" and not ops else 0.0
    replay = (m.activation_bytes(index, recompute="none", **kw) + held[1] + gathered + repeated + load_kept - fp8_less
              - act if rec != "none" else 0.0)
    ep_f, ep_b = expert_parallel_comm(cluster, plan, kind, rec, tp_ranks)
    return LayerCost(fwd_c, bwd_c, tp_f, tp_b, act, replay, params, bwd_weight_s=wgrad, fwd_cp_s=cp_f, bwd_cp_s=cp_b,
                     fwd_ep_s=ep_f, bwd_ep_s=ep_b, expert_params=experts)


def context_parallel_parts(plan, cluster: ClusterSpec, index: int, recompute: str, tp_ranks: list,
                           cp_ranks: list | None = None) -> tuple:
    """(forward s, backward s, bytes) of a layer's context parallelism per micro-batch: its K/V
    collectives (planner.comm.cp_comm) over the CP group of the rank that leads `tp_ranks` (or on
    `cp_ranks`), and the bytes of the other CP ranks' K and V that its attention keeps for the
    backward beside this rank's own, where it is not recomputed (a replay holds them again); with
    an MoE block's balancing loss, the all-reduce of its float32 routed counts (runtime.moe), a
    full recomputation's replay's again. Zeros without it."""
    m, t, cp = plan.model, plan.training, plan.mesh.cp
    if cp == 1 or m.layer_kind(index) != "block":
        return 0.0, 0.0, 0.0
    kv = 2 * DTYPES[t.dtype] * t.micro_batch * t.seq_len * m.kv_dim / plan.mesh.tp  # the whole sequence's
    ranks = cp_ranks if cp_ranks is not None else plan.mesh.group("cp", **plan.mesh.coords(tp_ranks[0]))
    fwd, bwd = cp_comm(cluster, "block", kv, ranks, recompute)
    if m.moe is not None and t.moe_aux_loss:
        counts = cluster.collective_time("all_reduce", 4 * m.moe.experts, ranks)
        fwd, bwd = fwd + counts, bwd + (counts if recompute == "full" else 0.0)
    return fwd, bwd, kv * (cp - 1) / cp


def replicated_params(model: ModelConfig, kind: str, matrices: bool = True) -> int:
    """Parameters of a layer every TP rank holds whole: norms (Qwen3's per-head q and k norms too),
    row-parallel biases, GPT's positions and, with `matrices`, an MoE block's router and shared
    expert's gate (planner.moe)."""
    h, gpt = model.hidden, model.arch == "gpt"
    moe = ffn_params(model)[1] if kind == "block" and model.moe is not None and matrices else 0
    return {"embedding": model.seq_len * h if gpt else 0, "head": 2 * h if gpt else h,
            "block": (6 * h if gpt else 2 * h) + qk_norm_params(model) + moe}[kind]


def qk_norm_params(model: ModelConfig) -> int:
    """A block's per-head query and key norm weights (Qwen3): held whole on every TP rank, their
    gradients partial sums over the TP group (each rank normalized its own heads), with or
    without sequence parallelism."""
    return 2 * model.dim_per_head if model.qk_norm else 0


def sp_partial_params(model: ModelConfig, kind: str) -> int:
    """Parameters whose gradients are partial sums over the TP group under sequence parallelism:
    the norms' (each TP rank normalizes its own tokens). Without data parallelism the runtime
    all-reduces them once a step (runtime.optim.reduce_partial_grads); FSDP2 reduces them itself."""
    norm = 2 * model.hidden if model.arch == "gpt" else model.hidden
    return {"embedding": 0, "head": norm, "block": 2 * norm}[kind]


def partial_grad_params(plan: Plan, pp_rank: int) -> int:
    """Parameters of pipeline rank `pp_rank` whose partial gradients the runtime makes whole before
    its optimizer step (runtime.optim.reduce_partial_grads): the norms of its sequence-parallel
    stages and the per-head q and k norms of its blocks, where no data parallelism (FSDP2, over
    dp x cp) reduces them."""
    m, mesh, stages = plan.model, plan.mesh, plan.pipeline.stages
    if mesh.tp == 1 or mesh.grad_ranks > 1:
        return 0
    return sum((sp_partial_params(m, kind) if stages[k].sequence_parallel else 0)
               + (qk_norm_params(m) if kind == "block" else 0)
               for k in plan.stages_of_rank(pp_rank) for kind in map(m.layer_kind, range(*stages[k].layers)))


def layer_params_on_device(model: ModelConfig, index: int, tp: int) -> float:
    """Parameters one TP rank holds for a layer: matrices split tp ways (the vocabulary in
    ceil(vocab / tp) rows, the most a rank holds: DTensor splits an odd one unevenly, the runtime's
    way; Megatron-LM pads it), replicated_params whole."""
    kind = model.layer_kind(index)
    rep = replicated_params(model, kind)
    if kind == "block":
        return (model.block_params() - rep) / tp + rep
    return math.ceil(model.vocab / tp) * model.hidden + rep


def tied_head(model: ModelConfig, cost: LayerCost, tp: int) -> LayerCost:
    """A tied head's cost in the stage that holds the embedding too: its projection is the
    embedding's matrix (one parameter in runtime.model, as in Megatron-LM without a pipeline), held,
    updated and synchronized once, with the embedding, so the head keeps only its final norm. In
    another stage (Megatron-LM's last stage; runtime.tied, on another rank or, under ZB-V, on the
    embedding's) the head keeps a copy: layer_cost's figure."""
    shared = math.ceil(model.vocab / tp) * model.hidden
    keep = max(0.0, cost.params - shared) / cost.params if cost.params else 0.0
    dp = {k: v * keep if isinstance(v, float) else v for k, v in cost.dp_measured.items()} if cost.dp_measured else None
    return replace(cost, params=max(0.0, cost.params - shared), optimizer_s=cost.optimizer_s * keep, dp_measured=dp)
