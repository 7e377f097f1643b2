"""Validation of a plan (planner.plan.Plan.validate): every rule, each failure one ConfigError that
names the field and says what to change."""
from __future__ import annotations

from planner.model import MAX_NAME, RECOMPUTE_MODES, ATTENTION_KERNELS, is_one_line, is_real
from planner.mesh import MESH_DIMS
from planner.plan import (DTYPES, GRAD_ACCUMULATION, LR_DECAYS, RECV_BUFFERS, SCHEDULES, SENT_OUTPUTS,
                          SP_SAVED_INPUTS, P2P_MODES, _is_int, _need)
from planner.fp8 import FP8_RECIPES
from planner.pointwise import ELEMENTWISE_KERNELS
from planner.precision import ADAM_MOMENTS
from planner.sac import SELECTIVE_RECOMPUTE, priced as sac_priced


# the most micro-batches a step may have: the schedule simulator plays every one (about 0.1 s per
# thousand on one core); far above real runs (a 2048-sequence batch, dp 1, micro-batch 1: 2048)
MAX_MICRO_BATCHES = 65536
MAX_LR = 10.0  # training.lr


def _one_of(value, options, path: str) -> None:
    _need(isinstance(value, str) and value in options, path, f"{value!r}; use one of {', '.join(options)}")


def check_optimizer(t) -> None:
    """The optimizer's settings of training `t`: lr, weight decay, clipping and the learning-rate schedule."""
    for name in ("lr", "weight_decay", "grad_clip"):
        v = getattr(t, name)
        _need(is_real(v) and v >= 0, f"training.{name}", f"{v!r} must be a finite non-negative number")
    # Adam moves each weight by about lr a step (Kingma & Ba 2015, section 2.1: the effective step is
    # bounded by about the step size): beyond MAX_LR training diverges at once (1e30: NaN at the
    # second step; 1e300 overflowed float32 inside AdamW's update, a traceback)
    _need(t.lr <= MAX_LR, "training.lr", f"{t.lr!r} must be at most {MAX_LR:g} (transformers train at 1e-5 "
                                         f"to 1e-2)")
    # AdamW multiplies each weight by 1 - lr * weight_decay a step (Loshchilov & Hutter 2019,
    # algorithm 2): at 1 or more it zeroes or flips every weight
    _need(t.lr * t.weight_decay < 1, "training.weight_decay",
          f"{t.weight_decay!r} times training.lr ({t.lr!r}) must be below 1 (AdamW scales each "
          f"weight by 1 - lr x weight_decay a step; 0.1 is usual)")
    for name in ("lr_warmup_steps", "lr_decay_steps"):
        v = getattr(t, name)
        _need(_is_int(v) and 0 <= v < 2**63, f"training.{name}", f"{v!r} must be a non-negative integer")
    _one_of(t.lr_decay, LR_DECAYS, "training.lr_decay")
    _need(is_real(t.min_lr) and 0 <= t.min_lr <= t.lr, "training.min_lr",
          f"{t.min_lr!r} must be a finite number from 0 to training.lr ({t.lr!r})")
    _need(t.lr_decay == "constant" or t.lr_decay_steps > t.lr_warmup_steps, "training.lr_decay_steps",
          f"{t.lr_decay_steps} must exceed training.lr_warmup_steps ({t.lr_warmup_steps}) under a "
          f"{t.lr_decay} decay: the step where the learning rate reaches min_lr")


def check(plan) -> None:
    """Raise ConfigError naming the first field of `plan` that is wrong and how to fix it."""
    m, t, c, mesh, p = plan.model, plan.training, plan.cluster, plan.mesh, plan.pipeline
    for name in ("global_batch", "micro_batch", "seq_len"):
        v = getattr(t, name)
        _need(_is_int(v) and v > 0, f"training.{name}", f"{v!r} must be a positive integer")
    _need(_is_int(t.seed) and 0 <= t.seed < 2**63, "training.seed",
          f"{t.seed!r} must be a non-negative integer below 2**63 (torch's seeds are 64-bit)")
    _one_of(t.dtype, DTYPES, "training.dtype")
    _need(t.optimizer == "adamw", "training.optimizer", f"{t.optimizer!r}; only adamw is supported")
    _one_of(t.attention, ATTENTION_KERNELS, "training.attention")
    _need(isinstance(t.master_weights, bool), "training.master_weights", "must be true or false")
    _one_of(t.adam_moments, ADAM_MOMENTS, "training.adam_moments")
    _need(isinstance(t.overlap_grad_reduce, bool), "training.overlap_grad_reduce", "must be true or false")
    _need(isinstance(t.overlap_param_gather, bool), "training.overlap_param_gather", "must be true or false")
    _need(isinstance(t.async_tp_allreduce, bool), "training.async_tp_allreduce", "must be true or false")
    _need(isinstance(t.tp_comm_overlap, bool), "training.tp_comm_overlap", "must be true or false")
    _need(isinstance(t.fsdp_copies, bool), "training.fsdp_copies", "must be true or false")
    _need(isinstance(t.defer_grad_sync, bool), "training.defer_grad_sync", "must be true or false")
    _need(isinstance(t.document_mask, bool), "training.document_mask", "must be true or false")
    _need(isinstance(t.eod_mask_loss, bool), "training.eod_mask_loss", "must be true or false")
    _need(isinstance(t.reset_position_ids, bool), "training.reset_position_ids", "must be true or false")
    _need(not t.reset_position_ids or t.document_mask, "training.reset_position_ids",
          "true needs training.document_mask true (positions restart where attention does); set both or neither")
    _need(is_real(t.moe_aux_loss) and 0 <= t.moe_aux_loss <= 1, "training.moe_aux_loss",
          f"{t.moe_aux_loss!r} must be a number from 0 to 1 (Switch Transformer's 0.01; 0: none)")
    _need(t.moe_aux_loss == 0 or m.moe is not None, "training.moe_aux_loss",
          "is for mixture-of-experts models; this model has no experts, set it to 0")
    _need(is_real(t.moe_load_factor) and t.moe_load_factor >= 1, "training.moe_load_factor",
          f"{t.moe_load_factor!r} must be a number of at least 1 (the busiest expert's rows over the mean; 1: balanced)")
    _need(t.moe_load_factor == 1 or m.moe is not None, "training.moe_load_factor",
          "is for mixture-of-experts models; this model has no experts, set it to 1")
    most = m.moe.experts / m.moe.experts_per_token if m.moe is not None else 1
    _need(t.moe_load_factor <= most, "training.moe_load_factor",
          f"{t.moe_load_factor:g} is more than experts / experts_per_token ({most:g}): an expert gets at most every token")
    _need(t.fp8 is None or (isinstance(t.fp8, str) and t.fp8 in FP8_RECIPES), "training.fp8",
          f"{t.fp8!r}; use one of {', '.join(FP8_RECIPES)}, or null for none")
    _need(isinstance(t.fp8_param_gather, bool), "training.fp8_param_gather",
          f"{t.fp8_param_gather!r}: must be true or false")
    _need(t.fp8 or not t.fp8_param_gather, "training.fp8_param_gather",
          "true gathers FP8 weights, which need FP8 linears: set training.fp8 (--fp8), or this to false")
    _need(t.fp8 is None or DTYPES.get(t.dtype) == 2, "training.fp8",
          "FP8 linears run inside 16-bit mixed precision; set training.dtype to bf16, or fp8 to null")
    _one_of(t.elementwise_kernels, ELEMENTWISE_KERNELS, "training.elementwise_kernels")
    _one_of(t.grad_accumulation, GRAD_ACCUMULATION, "training.grad_accumulation")
    _one_of(t.sp_saved_inputs, SP_SAVED_INPUTS, "training.sp_saved_inputs")
    _one_of(t.selective_recompute, SELECTIVE_RECOMPUTE, "training.selective_recompute")
    _need(t.selective_recompute != "ops" or sac_priced(m), "training.selective_recompute",
          "ops is priced for bias-free dense Llama-family blocks, torchtitan's (planner.sac: a biased product is "
          "aten.addmm, experts are grouped products, neither in its list); use attention")
    check_optimizer(t)
    _need(is_real(t.dropout) and 0 <= t.dropout < 1, "training.dropout", f"{t.dropout!r} must be from 0 to below 1")
    _need(t.attention_dropout is None or (is_real(t.attention_dropout) and 0 <= t.attention_dropout < 1),
          "training.attention_dropout", f"{t.attention_dropout!r} must be from 0 to below 1, or null (as dropout)")
    _need(t.seq_len <= m.seq_len, "training.seq_len",
          f"{t.seq_len} exceeds the model's seq_len {m.seq_len}; lower it or raise model.seq_len")
    for name in ("nodes", "devices_per_node"):
        v = getattr(c, name)
        _need(_is_int(v) and v > 0, f"cluster.{name}", f"{v!r} must be a positive integer")
    for name in ("name", "device", "profile_hash"):
        v = getattr(c, name)
        _need(is_one_line(v) or (name == "profile_hash" and v == ""),
              f"cluster.{name}", f"{v!r} must be a{'' if name == 'profile_hash' else ' non-empty'} printable string "
              f"of one line, at most {MAX_NAME} characters")
    for dim in MESH_DIMS + ("cp",):
        v = mesh.size(dim)
        _need(_is_int(v) and v > 0, f"mesh.{dim}", f"{v!r} must be a positive integer")
    dims = MESH_DIMS + ("cp",) if mesh.cp > 1 else MESH_DIMS
    _need(isinstance(mesh.order, list) and all(isinstance(d, str) for d in mesh.order)
          and sorted(mesh.order) in (sorted(dims), sorted(MESH_DIMS + ("cp",))), "mesh.order",
          f"{mesh.order!r} must list {', '.join(dims)} once each, outermost first"
          + (" (cp > 1: add cp, e.g. pp, dp, cp, tp)" if mesh.cp > 1 else ""))
    # causal attention is balanced by giving CP rank i sequence chunks i and 2 cp - 1 - i
    # (Llama 3, Dubey et al. 2024, section 3.3.2; torchtitan's load balancing): 2 cp chunks
    _need(mesh.cp == 1 or not t.document_mask, "training.document_mask",
          f"true with mesh.cp={mesh.cp}: a document mask is a dense s x s mask, which context parallelism's "
          "chunked attention does not take; set mesh.cp to 1 or document_mask to false")
    _need(mesh.cp == 1 or t.seq_len % (2 * mesh.cp) == 0, "mesh.cp",
          f"{mesh.cp}: the sequence ({t.seq_len} tokens) must split into 2 x cp = {2 * mesh.cp} equal chunks; "
          "pick a cp whose double divides training.seq_len")
    r = mesh.dp_replicate
    _need(_is_int(r) and r > 0, "mesh.dp_replicate", f"{r!r} must be a positive integer (1: no HSDP)")
    _need(mesh.dp % r == 0 and (r == 1 or mesh.dp // r * mesh.cp >= 2), "mesh.dp_replicate",
          f"{r} must divide dp={mesh.dp} and leave a shard group of at least 2 (dp / dp_replicate x cp); "
          "pick a divisor of dp below it, or 1")
    ep = mesh.ep
    _need(_is_int(ep) and ep > 0, "mesh.ep", f"{ep!r} must be a positive integer (1: no expert parallelism)")
    if ep > 1:
        _need(m.moe is not None, "mesh.ep", f"{ep}: expert parallelism needs a mixture-of-experts model; set it to 1")
        _need(m.moe.experts % ep == 0, "mesh.ep", f"{ep} does not divide model.moe.experts={m.moe.experts}; "
              "pick a divisor of it")
        _need(mesh.dp_shard % ep == 0, "mesh.ep", f"{ep} must divide the data-parallel shard group (dp / "
              f"dp_replicate = {mesh.dp_shard}), over which the experts are spread; pick a divisor of it")
    _need(mesh.world_size == c.world_size, "mesh",
          f"pp*dp*{'cp*' if mesh.cp > 1 else ''}tp = {mesh.pp}*{mesh.dp}*{f'{mesh.cp}*' if mesh.cp > 1 else ''}"
          f"{mesh.tp} = {mesh.world_size} but the cluster has "
          f"{c.world_size} GPUs ({c.nodes} nodes x {c.devices_per_node}); make the degrees multiply to {c.world_size}")
    _need(mesh.tp <= c.devices_per_node, "mesh.tp",
          f"{mesh.tp} is larger than a node ({c.devices_per_node} devices); TP groups must stay inside a node")
    for fld, n in m.tp_split_sizes():
        _need(n % mesh.tp == 0, "mesh.tp", f"{mesh.tp} does not divide model.{fld}={n}; pick a TP degree that divides it")
    _need(t.global_batch % (mesh.dp * t.micro_batch) == 0, "training.global_batch",
          f"{t.global_batch} is not divisible by dp x micro_batch = {mesh.dp} x {t.micro_batch}; "
          f"use a multiple of {mesh.dp * t.micro_batch}")
    _one_of(p.schedule, SCHEDULES, "pipeline.schedule")
    _need(_is_int(p.virtual_stages) and p.virtual_stages >= 1, "pipeline.virtual_stages",
          f"{p.virtual_stages!r} must be a positive integer")
    if p.virtual_stages > 1:
        _need(p.schedule in ("interleaved-1f1b", "zbv"), "pipeline.virtual_stages",
              f"{p.virtual_stages} needs schedule interleaved-1f1b or zbv; set it to 1 for {p.schedule}")
        _need(mesh.pp > 1, "pipeline.virtual_stages", "interleaving needs pp > 1; set it to 1")
    if p.schedule == "zbv" and mesh.pp > 1:
        _need(p.virtual_stages == 2, "pipeline.virtual_stages",
              f"{p.virtual_stages}, but zbv runs exactly two stages per pipeline rank; set it to 2")
    _need(isinstance(p.lockstep, bool), "pipeline.lockstep", "must be true or false")
    _need(not p.lockstep or p.schedule == "1f1b", "pipeline.lockstep",
          f"lock-step execution plays 1f1b only (DeepSpeed's TrainSchedule), not {p.schedule}; set it to false")
    _one_of(p.recv_buffers, RECV_BUFFERS, "pipeline.recv_buffers")
    _one_of(p.sent_outputs, SENT_OUTPUTS, "pipeline.sent_outputs")
    _one_of(p.p2p, P2P_MODES, "pipeline.p2p")
    expected_mb = t.global_batch // (mesh.dp * t.micro_batch)
    _need(_is_int(p.micro_batches) and p.micro_batches > 0, "pipeline.micro_batches",
          f"{p.micro_batches!r} must be a positive integer; set it to {expected_mb}")
    _need(expected_mb <= MAX_MICRO_BATCHES, "training.global_batch",
          f"{t.global_batch} makes {expected_mb} micro-batches of {t.micro_batch} per data-parallel rank, more than "
          f"{MAX_MICRO_BATCHES}; raise training.micro_batch or dp, or lower the global batch")
    _need(p.micro_batches == expected_mb, "pipeline.micro_batches",
          f"{p.micro_batches} but global_batch / (dp x micro_batch) = {expected_mb}; set it to {expected_mb}")
    if mesh.pp > 1 and p.schedule == "1f1b":
        _need(p.micro_batches >= mesh.pp, "pipeline.micro_batches",
              f"{p.micro_batches} is fewer than pp={mesh.pp}; 1F1B needs at least one micro-batch per stage "
              "(use gpipe, a smaller micro-batch, or a larger global batch)")
    if mesh.pp > 1 and p.schedule == "interleaved-1f1b":
        _need(p.micro_batches % mesh.pp == 0, "pipeline.micro_batches",
              f"{p.micro_batches} must be a multiple of pp={mesh.pp} for interleaved-1f1b; change the micro-batch size or global batch")
    n_stages = mesh.pp * p.virtual_stages
    _need(len(p.stages) == n_stages, "pipeline.stages",
          f"{len(p.stages)} stages but pp x virtual_stages = {n_stages}; give one entry per stage")
    expect = 0
    total = m.num_layers_total
    for i, st in enumerate(p.stages):
        w = f"pipeline.stages[{i}]"
        _need(isinstance(st.layers, list) and len(st.layers) == 2 and all(_is_int(x) for x in st.layers),
              f"{w}.layers", f"{st.layers!r} must be [start, end)")
        _need(st.start == expect, f"{w}.layers",
              f"starts at {st.start} but layer {expect} is next; stages must cover layers 0..{total - 1} "
              "(0 = embedding, last = head) exactly once, in order")
        _need(st.end > st.start, f"{w}.layers", f"{st.layers} is empty; every stage needs at least one layer")
        _need(st.end <= total, f"{w}.layers", f"ends at {st.end} beyond the last layer {total - 1}")
        _need(_is_int(st.zero) and 0 <= st.zero <= 3, f"{w}.zero", f"{st.zero!r}; use 0, 1, 2 or 3")
        _need(isinstance(st.recompute, list) and len(st.recompute) == st.num_layers, f"{w}.recompute",
              f"needs one mode per layer ({st.num_layers}), got {len(st.recompute) if isinstance(st.recompute, list) else st.recompute!r}")
        for j, r in enumerate(st.recompute):
            _one_of(r, RECOMPUTE_MODES, f"{w}.recompute")
            if 0 <= st.start + j < total and m.layer_kind(st.start + j) != "block":
                _need(r == "none", f"{w}.recompute",
                      f"layer {st.start + j} is the {m.layer_kind(st.start + j)}; only blocks are recomputed, use \"none\"")
        _need(isinstance(st.sequence_parallel, bool), f"{w}.sequence_parallel", "must be true or false")
        _need(not st.sequence_parallel or mesh.tp > 1, f"{w}.sequence_parallel",
              "sequence parallelism needs tp > 1; set it to false")
        expect = st.end
    sps = {st.sequence_parallel for st in p.stages}
    _need(len(sps) <= 1, "pipeline.stages", "sequence_parallel differs between stages; the activations passed "
          "between stages are split by sequence under it, so set it the same on every stage")
    _need(expect == total, "pipeline.stages",
          f"cover layers up to {expect - 1} but the model has layers 0..{total - 1}; the last stage must end at {total}")
    _need(mesh.dp_replicate == 1 or all(st.zero >= 1 for st in p.stages), "mesh.dp_replicate",
          f"{mesh.dp_replicate} (HSDP) shards within groups of dp / dp_replicate, which needs ZeRO 1-3 on every "
          "stage; set the stages' zero to 1, 2 or 3, or dp_replicate to 1")
    _need(not (t.defer_grad_sync and p.schedule == "zbv" and mesh.pp > 1), "training.defer_grad_sync",
          "true is not for zbv, whose split backward reduces each micro-batch's weight gradients at W; set it false")
    _need(plan.prediction is None or isinstance(plan.prediction, dict), "prediction", "must be an object or null")
