"""Validation of a plan (planner.plan.Plan.validate): every rule, each failure one ConfigError that
names the field and says what to change."""
from __future__ import annotations

from planner.model import RECOMPUTE_MODES, ATTENTION_KERNELS
from planner.plan import (DTYPES, GRAD_ACCUMULATION, MESH_DIMS, RECV_BUFFERS, SCHEDULES, P2P_MODES, _is_int,
                          _need)
from planner.pointwise import ELEMENTWISE_KERNELS


def check(plan) -> None:
    """Raise ConfigError naming the first field of `plan` that is wrong and how to fix it."""
    m, t, c, mesh, p = plan.model, plan.training, plan.cluster, plan.mesh, plan.pipeline
    for name in ("global_batch", "micro_batch", "seq_len", "seed"):
        v = getattr(t, name)
        _need(_is_int(v) and (v > 0 or name == "seed") and v >= 0, f"training.{name}",
              f"{v!r} must be a positive integer")
    _need(t.dtype in DTYPES, "training.dtype", f"{t.dtype!r}; use one of {', '.join(DTYPES)}")
    _need(t.optimizer == "adamw", "training.optimizer", f"{t.optimizer!r}; only adamw is supported")
    _need(t.attention in ATTENTION_KERNELS, "training.attention",
          f"{t.attention!r}; use one of {', '.join(ATTENTION_KERNELS)}")
    _need(isinstance(t.master_weights, bool), "training.master_weights", "must be true or false")
    _need(isinstance(t.overlap_grad_reduce, bool), "training.overlap_grad_reduce", "must be true or false")
    _need(isinstance(t.async_tp_allreduce, bool), "training.async_tp_allreduce", "must be true or false")
    _need(isinstance(t.fsdp_copies, bool), "training.fsdp_copies", "must be true or false")
    _need(t.elementwise_kernels in ELEMENTWISE_KERNELS, "training.elementwise_kernels",
          f"{t.elementwise_kernels!r}; use one of {', '.join(ELEMENTWISE_KERNELS)}")
    _need(t.grad_accumulation in GRAD_ACCUMULATION, "training.grad_accumulation",
          f"{t.grad_accumulation!r}; use one of {', '.join(GRAD_ACCUMULATION)}")
    for name in ("lr", "weight_decay", "grad_clip", "dropout"):
        v = getattr(t, name)
        _need(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0, f"training.{name}",
              f"{v!r} must be a non-negative number")
    _need(t.dropout < 1, "training.dropout", f"{t.dropout} must be below 1")
    _need(t.seq_len <= m.seq_len, "training.seq_len",
          f"{t.seq_len} exceeds the model's seq_len {m.seq_len}; lower it or raise model.seq_len")
    for name in ("nodes", "devices_per_node"):
        v = getattr(c, name)
        _need(_is_int(v) and v > 0, f"cluster.{name}", f"{v!r} must be a positive integer")
    for dim in MESH_DIMS:
        v = mesh.size(dim)
        _need(_is_int(v) and v > 0, f"mesh.{dim}", f"{v!r} must be a positive integer")
    _need(isinstance(mesh.order, list) and sorted(mesh.order) == sorted(MESH_DIMS), "mesh.order",
          f"{mesh.order!r} must list pp, dp and tp once each, outermost first")
    _need(mesh.world_size == c.world_size, "mesh",
          f"pp*dp*tp = {mesh.pp}*{mesh.dp}*{mesh.tp} = {mesh.world_size} but the cluster has "
          f"{c.world_size} GPUs ({c.nodes} nodes x {c.devices_per_node}); make the degrees multiply to {c.world_size}")
    _need(mesh.tp <= c.devices_per_node, "mesh.tp",
          f"{mesh.tp} is larger than a node ({c.devices_per_node} devices); TP groups must stay inside a node")
    for fld, n in (("heads", m.heads), ("kv_heads", m.kv_heads), ("ffn_hidden", m.ffn_hidden)):
        _need(n % mesh.tp == 0, "mesh.tp", f"{mesh.tp} does not divide model.{fld}={n}; pick a TP degree that divides it")
    _need(t.global_batch % (mesh.dp * t.micro_batch) == 0, "training.global_batch",
          f"{t.global_batch} is not divisible by dp x micro_batch = {mesh.dp} x {t.micro_batch}; "
          f"use a multiple of {mesh.dp * t.micro_batch}")
    _need(p.schedule in SCHEDULES, "pipeline.schedule", f"{p.schedule!r}; use one of {', '.join(SCHEDULES)}")
    _need(_is_int(p.virtual_stages) and p.virtual_stages >= 1, "pipeline.virtual_stages",
          f"{p.virtual_stages!r} must be a positive integer")
    if p.virtual_stages > 1:
        _need(p.schedule == "interleaved-1f1b", "pipeline.virtual_stages",
              f"{p.virtual_stages} needs schedule interleaved-1f1b; set it to 1 for {p.schedule}")
        _need(mesh.pp > 1, "pipeline.virtual_stages", "interleaving needs pp > 1; set it to 1")
    _need(isinstance(p.lockstep, bool), "pipeline.lockstep", "must be true or false")
    _need(not p.lockstep or p.schedule == "1f1b", "pipeline.lockstep",
          f"lock-step execution plays 1f1b only (DeepSpeed's TrainSchedule), not {p.schedule}; set it to false")
    _need(p.recv_buffers in RECV_BUFFERS, "pipeline.recv_buffers",
          f"{p.recv_buffers!r}; use one of {', '.join(RECV_BUFFERS)}")
    _need(p.p2p in P2P_MODES, "pipeline.p2p", f"{p.p2p!r}; use one of {', '.join(P2P_MODES)}")
    expected_mb = t.global_batch // (mesh.dp * t.micro_batch)
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
            _need(r in RECOMPUTE_MODES, f"{w}.recompute", f"{r!r}; use one of {', '.join(RECOMPUTE_MODES)}")
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
    _need(plan.prediction is None or isinstance(plan.prediction, dict), "prediction", "must be an object or null")
