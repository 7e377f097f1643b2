"""Model profiles: measured per-layer times and bytes of one model on one cluster
(profiles/models/NAME.json, written by `trident profile model`, i.e. runtime.profile model).

Format (format_version 1):

    {
      "format_version": 1,
      "name": "tiny@cpu-gloo-4",
      "model": {...ModelConfig fields...},
      "seq_len": 32,                      # sequence length the layers were timed at
      "dtype": "fp32",                    # compute dtype of the measurement
      "processes": 4,                     # processes running the measurement at once (see below)
      "cluster_profile": {"name": "cpu-gloo-4", "hash": "sha256:..."},
      "micro_batches": [1, 2, 4],         # micro-batch sizes measured
      "entries": [
        {"layer": "block", "tp": 2, "sequence_parallel": false, "recompute": "none",
         "forward_s": [a, b], "backward_s": [a, b], "activation_bytes": [a, b],
         "optimizer_s": 1.2e-4, "param_bytes": 123, "grad_bytes": 123,
         "points": [[mb, forward_s, backward_s, activation_bytes], ...]},
        ...
      ],
      "sources": {...}
    }

`forward_s`, `backward_s` and `activation_bytes` are linear fits a + b * micro_batch (least
squares over `points`), so a plan may ask for a micro-batch size that was not measured.
Times are per layer, per micro-batch, on one device, and include the layer's tensor-parallel
communication as the runtime issues it (DTensor collectives on the profiled cluster);
`backward_s` includes the replay of a recomputed block. `optimizer_s` is the runtime's gradient
clipping and AdamW step on the layer's parameters. `layer` is embedding | block | head.
A block entry with `"cp": C` (`trident profile model --cp 1,C`) was measured under context
parallelism: C ranks (0, tp, 2 tp, ...) each computing its share of every sequence, its K/V
collectives inside, at `micro_batch` sequences split over them (profiled_layer_cost).
Entries without recomputation may carry `data_parallel`: {"dp": D, "micro_batch": mb, "zero0" |
"zero1" | "zero3": {forward_s, backward_s, backward_sync_s, optimizer_s}}, the layer wrapped as
the runtime wraps it (replicate, FSDP2 without / with resharding after forward) on a dp group of
D: extra forward and backward seconds per micro-batch over the unwrapped layer, the extra of the
backward that synchronizes gradients (once per step), and the optimizer step on the wrapped
parameters (replacing `optimizer_s`).
An optional top-level `pipeline`: {"gpipe" | "1f1b" | "interleaved-1f1b": {"overhead_per_op_s": x,
"step_s": ...}} is
the measured per-operation overhead of torch.distributed.pipelining beyond compute and transfers
(runtime.profile_pipeline.measure_pipeline), added to every forward and backward of a pipelined plan.

`processes` matters on a machine whose "devices" are processes sharing CPU cores: every rank of
a `profile model` launch measures at once, so the times are those of a device when that many
processes share the machine, and a plan should be priced with a profile measured at its own
world size.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from planner.model import ConfigError, ModelConfig
from planner.model_profile_checks import check_model_profile
from planner.plan import split_backward
from planner.unmeasured import unmeasured, unmeasured_delta

if TYPE_CHECKING:  # annotations only: planner.cost and planner.plan import this module's users
    from planner.cluster import ClusterSpec
    from planner.layers import LayerCost
    from planner.plan import Plan, Stage

FORMAT_VERSION = 1
PROFILE_DIR = Path(__file__).resolve().parent.parent / "profiles" / "models"
LATENCY_ONLY_BUS_BANDWIDTH = 1e15  # B/s: a message of 1 GB costs 1 us, nothing against any alpha


def fit_linear(xs, ys, weights=None) -> tuple[float, float]:
    """Least-squares a, b of y = a + b x (weighted if `weights`); one point gives (y, 0)."""
    xs, ys = [float(x) for x in xs], [float(y) for y in ys]
    w = [1.0] * len(xs) if weights is None else [float(v) for v in weights]
    sw = sum(w)
    if len(set(xs)) < 2:
        return sum(wi * y for wi, y in zip(w, ys)) / sw, 0.0
    mx = sum(wi * x for wi, x in zip(w, xs)) / sw
    my = sum(wi * y for wi, y in zip(w, ys)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, x in zip(w, xs))
    sxy = sum(wi * (x - mx) * (y - my) for wi, x, y in zip(w, xs, ys))
    b = sxy / sxx
    return my - b * mx, b


def fit_alpha_beta(factor_bytes, times) -> tuple[float, float]:
    """alpha (s) and bus bandwidth (B/s) of t = alpha + factor * S / busbw, least squares on the
    relative error (weights 1/t^2, so small and large messages count alike); alpha >= 0 and
    busbw > 0 enforced (refit through the origin or a pure-latency fit otherwise). A slope too
    small to price (equal times but for rounding) is a latency-only fit too: a profile stores bus
    bandwidths up to 1e18 B/s (planner.device.RANGES), so a fit never writes one above
    LATENCY_ONLY_BUS_BANDWIDTH."""
    w = [1.0 / t ** 2 for t in times]
    a, b = fit_linear(factor_bytes, times, w)
    if b * LATENCY_ONLY_BUS_BANDWIDTH <= 1.0:  # no bandwidth term visible: latency only
        return sum(times) / len(times), LATENCY_ONLY_BUS_BANDWIDTH
    if a < 0:  # through the origin
        b = sum(wi * x * y for wi, x, y in zip(w, factor_bytes, times)) / sum(wi * x * x for wi, x in zip(w, factor_bytes))
        a = 0.0
    return a, min(1.0 / b, LATENCY_ONLY_BUS_BANDWIDTH)


def fit_segments(sizes, factor_bytes, times, tol: float = 0.15) -> list:
    """Piecewise alpha-beta over message sizes: the fewest runs of consecutive sizes whose own fit
    reproduces each of their points within `tol` (gloo and NCCL switch algorithms with the size,
    so one line rarely fits 4 KiB .. 16 MiB). Returns [(up_to_bytes or None, alpha_s, busbw)], the
    boundary between two runs at the geometric mean of their neighbouring sizes."""
    n = len(sizes)

    def seg(i, j):  # fit of points i..j-1 and its worst relative error
        a, bw = fit_alpha_beta(factor_bytes[i:j], times[i:j])
        err = max(abs(a + x / bw - t) / t for x, t in zip(factor_bytes[i:j], times[i:j]))
        return err, a, bw

    best = {0: (0, 0.0, [])}  # points covered -> (segments, worst error, fits)
    for j in range(1, n + 1):
        cands = []
        for i in range(j):
            err, a, bw = seg(i, j)
            if err <= tol or j - i == 1:
                k, worst, fits = best[i]
                cands.append((k + 1, max(worst, err), fits + [(i, j, a, bw)]))
        best[j] = min(cands, key=lambda c: (c[0], c[1]))
    out = []
    for i, j, a, bw in best[n][2]:
        up_to = (sizes[j - 1] * sizes[j]) ** 0.5 if j < n else None
        out.append((up_to, a, bw))
    return out


@dataclass
class LayerFit:
    forward_s: tuple
    backward_s: tuple
    activation_bytes: tuple
    param_bytes: float
    grad_bytes: float
    optimizer_s: float = 0.0
    points: list = field(default_factory=list)
    data_parallel: dict = field(default_factory=dict)  # "dp", "zero0" / "zero1" / "zero3" -> extra seconds

    def dp_overhead(self, zero: int) -> dict | None:
        """The measured extra of running the layer under data parallelism at this ZeRO level
        (forward_s, backward_s per micro-batch, backward_sync_s once per step, optimizer_s), or None."""
        return self.data_parallel.get("zero0" if zero == 0 else "zero3" if zero == 3 else "zero1")

    @staticmethod
    def _at(ab, mb: int) -> float:
        return max(0.0, ab[0] + ab[1] * mb)

    def forward(self, mb: int) -> float:
        return self._at(self.forward_s, mb)

    def backward(self, mb: int) -> float:
        return self._at(self.backward_s, mb)

    def activations(self, mb: int) -> float:
        return self._at(self.activation_bytes, mb)


@dataclass
class ModelProfile:
    name: str
    model: ModelConfig
    seq_len: int
    dtype: str
    processes: int
    cluster_name: str
    cluster_hash: str
    micro_batches: list
    entries: dict  # (layer, tp, sp, recompute, cp) -> LayerFit
    pipeline: dict = field(default_factory=dict)  # schedule -> {"overhead_per_op_s": ...}
    # the dtype of the parameters whose bytes were measured: the runtime keeps float32 weights and
    # computes in bf16 by autocast, so param_bytes count 4 bytes a parameter in bf16 profiles too
    param_dtype: str = "fp32"
    # what its sequence-parallel entries kept of their gathered inputs (training.sp_saved_inputs):
    # the runtime's default when measured; profiles written before runtime.sp_shard kept them whole
    sp_saved_inputs: str = "gathered"
    profile_hash: str = ""
    raw: dict = field(default_factory=dict, repr=False)

    def lookup(self, layer: str, tp: int, sequence_parallel: bool, recompute: str, cp: int = 1) -> LayerFit | None:
        """The layer's measurement; under context parallelism (`cp` > 1) a block measured at that
        cp (its K/V collectives on ranks 0, tp, 2 tp, ... included), else None."""
        sp = bool(sequence_parallel) and tp > 1
        rec = recompute if layer == "block" else "none"
        if cp > 1:
            return self.entries.get((layer, tp, sp, rec, cp)) if layer == "block" else None
        key = (layer, tp, sp, rec, 1)
        if key not in self.entries:
            raise ConfigError(f"model profile {self.name}: no measurement of the {layer} at tp={tp}, "
                              f"sequence_parallel={sp}, recompute={rec}; re-run `trident profile model` with "
                              f"--tp including {tp}")
        return self.entries[key]

    def pipeline_overhead(self, schedule: str) -> float:
        """Measured seconds per pipeline operation (F, B, or a split backward's I or W) of
        torch.distributed.pipelining beyond compute and transfers; a schedule the profile did not
        measure takes the nearest one's (zbv: interleaved 1F1B's, two stages a rank; interleaved
        1F1B: 1F1B's). 0 when not measured."""
        for key in {"zbv": ("zbv", "interleaved-1f1b", "1f1b"),
                    "interleaved-1f1b": ("interleaved-1f1b", "1f1b")}.get(schedule, (schedule,)):
            if key in self.pipeline:
                return float((self.pipeline.get(key) or {}).get("overhead_per_op_s", 0.0))
        return 0.0

    def check_plan(self, plan) -> None:
        """ConfigError (one line) when the plan is not the model / seq_len / dtype profiled."""
        if plan.model != self.model:
            raise ConfigError(f"model profile {self.name}: profiles model {self.model.name!r} but the plan trains "
                              f"{plan.model.name!r} (or another config); profile the plan's model")
        if plan.training.seq_len != self.seq_len:
            raise ConfigError(f"model profile {self.name}: measured at seq_len {self.seq_len} but the plan uses "
                              f"{plan.training.seq_len}; profile with --seq-len {plan.training.seq_len}")
        if plan.training.dtype != self.dtype:
            raise ConfigError(f"model profile {self.name}: measured in {self.dtype} but the plan computes in "
                              f"{plan.training.dtype}")


def profiled_layer_cost(plan: Plan, cluster: ClusterSpec, index: int, stage: Stage, tp_ranks: list,
                        profile, dp_extras: bool = True) -> LayerCost:
    """A layer priced from a model profile (planner.model_profile): forward and backward times from
    the measured fits at the plan's micro-batch size. The measured times include the TP collectives
    the runtime issued while they were measured; so that TP communication is not counted twice and
    still shows in the breakdown, the cluster profile's prediction of those collectives where they
    were measured (ranks 0..tp-1) is subtracted from the measured time to give the compute term (at
    most the whole measured time). The TP term is that measured share plus the difference between
    the cluster profile's prediction at the plan's TP ranks and at the measured ones: the same
    figure as measured for a group on the measured tier, more for a group spanning nodes.
    Activation and parameter bytes are the measured ones; under expert parallelism (measured
    without) a rank holds experts / ep of an MoE block's experts (planner.moe.held_experts), its
    all-to-alls are priced as the analytic model prices them and its data-parallel collectives
    too (the measured ones moved every expert). Under context parallelism (measured
    without) a rank computes 1 / cp of each sequence: the fits at micro_batch / cp, with the K/V
    collectives and kept bytes of planner.layers.context_parallel_parts. Without `dp_extras` the
    layer's measured data-parallel extras are left out, as the search prices data parallelism itself
    (planner.search.Ctx.layers), and `stage` needs no ZeRO level."""
    from planner.comm import regathers, tp_comm
    from planner.layers import LayerCost, context_parallel_parts, layer_cost
    from planner.moe import expert_parallel_comm, held_experts
    from planner.plan import DTYPES
    from planner.precision import grad_bytes, optimizer_step_bytes, sp_gathered_bytes
    m, t = plan.model, plan.training
    cp, tp = plan.mesh.cp, plan.mesh.tp
    b, s, sp = t.micro_batch / cp, t.seq_len, stage.sequence_parallel  # b: the rank's share, in sequences
    e = DTYPES[t.dtype]
    kind = m.layer_kind(index)
    rec = stage.recompute[index - stage.start]
    # a block measured under the plan's context parallelism (its K/V collectives on ranks 0, tp,
    # 2 tp, ... inside), at the plan's micro-batch; else the layer measured whole, at the rank's share
    measured_cp = profile.lookup(kind, tp, sp, rec, cp) if cp > 1 else None
    fit, fb = (measured_cp, t.micro_batch) if measured_cp else (profile.lookup(kind, tp, sp, rec), b)
    params = fit.param_bytes / DTYPES[profile.param_dtype]  # the measured parameter bytes, in elements
    experts = held_experts(m, kind, plan.mesh.tp, plan.mesh.ep)  # the rank's share where spread
    params -= experts * (plan.mesh.ep - 1)
    msg = e * b * s * m.hidden
    # the profile measured TP on consecutive ranks 0..tp-1 (runtime.profile_model), inside a node
    # where the node is large enough; the plan's TP group may sit elsewhere (across nodes)
    measured_t = dataclasses.replace(t, sp_saved_inputs=profile.sp_saved_inputs)
    prof_f, prof_b = tp_comm(cluster, kind, msg, sp, list(range(len(tp_ranks))), b, s, regathers(measured_t, rec))
    split = split_backward(plan.pipeline.schedule, plan.mesh.pp)  # measured without a pipeline
    tp_f, tp_b = tp_comm(cluster, kind, msg, sp, tp_ranks, b, s, regathers(t, rec, split))
    if rec == "full":
        prof_b += prof_f
        tp_b += tp_f
    fwd, bwd = fit.forward(fb), fit.backward(fb)
    in_f, in_b = min(prof_f, fwd), min(prof_b, bwd)  # the measured time's TP share
    fwd, bwd = fwd - in_f, bwd - in_b  # compute
    # the plan's TP communication: the measured share, plus what the plan's tier costs beyond the
    # tier it was measured on (a TP group spanning nodes), or less where the plan's tier is faster
    tp_f, tp_b = max(0.0, in_f + tp_f - prof_f), max(0.0, in_b + tp_b - prof_b)
    cp_f, cp_b, kv = context_parallel_parts(plan, cluster, index, rec, tp_ranks)
    if measured_cp:  # its K/V collectives likewise: the measured share moved to the plan's CP group
        pf, pb, _ = context_parallel_parts(plan, cluster, index, rec, tp_ranks, list(range(0, cp * tp, tp)))
        in_cf, in_cb = min(pf, fwd), min(pb, bwd)
        fwd, bwd = fwd - in_cf, bwd - in_cb
        cp_f, cp_b, kv = max(0.0, in_cf + cp_f - pf), max(0.0, in_cb + cp_b - pb), 0.0  # K/V kept: measured
    # the plan's sequence parallelism may keep its gathered inputs otherwise than the measured one
    gathered = [sp_gathered_bytes(m, tt, index, r, b, s, plan.mesh.tp, sp, replay=rec == "full" and r == "none")
                for tt in (t, measured_t) for r in (rec, "none")]
    act = fit.activations(fb) + gathered[0] - gathered[2] + (kv if rec == "none" else 0.0)
    replay = 0.0
    if rec != "none":
        none_fit, nb = ((profile.lookup(kind, tp, sp, "none", cp), fb) if measured_cp
                        else (profile.lookup(kind, tp, sp, "none"), b))
        if none_fit is None:
            raise ConfigError(f"model profile {profile.name}: the block at cp={cp} is measured with recompute={rec} "
                              f"but not without; re-run `trident profile model` with --cp {cp}")
        none = none_fit.activations(nb) + gathered[1] - gathered[3] + kv
        replay = max(0.0, none - act)
    dpm = None
    if dp_extras and plan.mesh.grad_ranks > 1 and not experts:
        base = profile.lookup(kind, plan.mesh.tp, sp, "none")
        dpm = base.dp_overhead(stage.zero)
        if dpm:
            r = plan.stage_rank(plan.pipeline.stages.index(stage))
            dp_ranks = plan.mesh.shard_group(pp=r, tp=0)  # HSDP's replicas: planner.cost
            measured = base.data_parallel.get("dp", plan.mesh.dp)
            dpm = dp_at_plan_ranks(dpm, cluster, stage.zero, (params * e, params * grad_bytes(t)), dp_ranks,
                                   [i * plan.mesh.tp for i in range(measured)])
            if stage.zero >= 1:  # its optimizer stepped 1 / measured of the parameters: the plan's share
                more = params * optimizer_step_bytes(t) * (1 / plan.mesh.zero_shards - 1 / measured)
                dpm = dict(dpm, optimizer_s=max(0.0, dpm["optimizer_s"] + more / cluster.device.memory_bytes_per_s))
    # the measured step of the layer's parameters, of those the rank holds under expert parallelism
    opt = dpm["optimizer_s"] if dpm else fit.optimizer_s * params / (fit.param_bytes / DTYPES[profile.param_dtype])
    # measured without any of these (planner.unmeasured)
    if unmeasured(plan):
        d = unmeasured_delta(plan, cluster, index, stage, tp_ranks)
        fwd, bwd, act, replay = (x + dx for x, dx in zip((fwd, bwd, act, replay), d))
        tp_f, tp_b = max(0.0, tp_f + d[4]), max(0.0, tp_b + d[5])
    wshare = 0.0
    if plan.pipeline.schedule == "zbv":  # the weights' share of the measured backward, as the analytic
        analytic = layer_cost(plan, cluster, index, stage, tp_ranks)  # model splits it (measured whole)
        wshare = analytic.bwd_weight_s / analytic.bwd_compute_s if analytic.bwd_compute_s > 0 else 0.0
    ep_f, ep_b = expert_parallel_comm(cluster, plan, kind, rec, tp_ranks)
    return LayerCost(fwd, bwd, tp_f, tp_b, act, replay, params, opt, dpm, bwd_weight_s=bwd * wshare,
                     fwd_cp_s=cp_f, bwd_cp_s=cp_b, fwd_ep_s=ep_f, bwd_ep_s=ep_b, expert_params=experts)


def dp_at_plan_ranks(dpm: dict, cluster, zero: int, nbytes: tuple, plan_ranks: list, measured_ranks: list) -> dict:
    """A layer's measured data-parallel extras moved from the dp group they were measured on
    (runtime.profile_model: ranks 0, tp, 2 tp, ...) to the plan's: each extra plus the difference of
    the cluster profile's prediction of its collectives on the two groups (a group of another size
    or on another tier). ZeRO-3 gathers the layer before each forward and backward (FSDP2 resharding
    after forward); ZeRO-1/2 reduce-scatters its gradients (and gathers it once per step, priced by
    the caller at the plan's ranks, as is ZeRO-0's all-reduce). `nbytes`: (gathered, reduced) bytes
    of the layer, in the dtypes its parameters are gathered and its gradients reduced in."""
    if zero == 0 or plan_ranks == measured_ranks:
        return dpm

    def diff(op, n):
        return cluster.collective_time(op, n, plan_ranks) - cluster.collective_time(op, n, measured_ranks)
    ag, rs = diff("all_gather", nbytes[0]), diff("reduce_scatter", nbytes[1])
    out = dict(dpm)
    if zero == 3:
        out["forward_s"] = max(0.0, dpm["forward_s"] + ag)
        out["backward_s"] = max(0.0, dpm["backward_s"] + ag)
        out["backward_sync_s"] = max(0.0, dpm["backward_sync_s"] + rs)
    else:
        out["backward_sync_s"] = max(0.0, dpm["backward_sync_s"] + rs)
    return out


def model_profile_from_dict(d, source: str = "model profile") -> ModelProfile:
    """Parse and check a model profile; every error is one line naming the field
    (planner.model_profile_checks)."""
    check_model_profile(d, source, FORMAT_VERSION)
    try:
        model = ModelConfig.from_dict(d["model"], where="model")
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    entries = {}
    for e in d["entries"]:
        rec = e.get("recompute", "none")
        key = (e["layer"], e["tp"], bool(e.get("sequence_parallel", False)), rec, e.get("cp", 1))
        fits = [tuple(float(x) for x in e[fld]) for fld in ("forward_s", "backward_s", "activation_bytes")]
        entries[key] = LayerFit(*fits, float(e["param_bytes"]), float(e["grad_bytes"]), float(e.get("optimizer_s", 0.0)),
                                e.get("points", []), e.get("data_parallel", {}))
    cp = d["cluster_profile"]
    return ModelProfile(name=d["name"], model=model, seq_len=d["seq_len"], dtype=d["dtype"],
                        processes=d.get("processes", 1), cluster_name=cp["name"], cluster_hash=cp.get("hash", ""),
                        micro_batches=list(d.get("micro_batches", [])), entries=entries, pipeline=d.get("pipeline", {}),
                        param_dtype=d.get("param_dtype", "fp32"), sp_saved_inputs=d.get("sp_saved_inputs", "gathered"),
                        raw=d)


def load_model_profile(spec) -> ModelProfile:
    """A path, or a name under profiles/models/."""
    from planner.cluster import read_profile
    path, data, digest = read_profile(spec, PROFILE_DIR, "--model-profile")
    try:
        prof = model_profile_from_dict(data, source=str(path))
    except ConfigError as exc:
        raise ConfigError(f"--model-profile: {path} is not a model profile as `trident profile model` writes "
                          f"them ({exc})") from None
    prof.profile_hash = digest
    return prof
