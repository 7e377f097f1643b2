"""Readable tables (pandas) and pictures (matplotlib) of an estimate."""
from __future__ import annotations

import pandas as pd

from planner.cost import Estimate
from planner.model import ConfigError
from planner.plan import Plan

GiB = 2**30


def _fmt_bytes(x: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(x) >= size:
            return f"{x / size:,.2f} {unit}"
    return f"{x:,.0f} B"


def sp_mode(plan: Plan) -> str:
    """A plan's sequence parallelism in a word: off, or what it keeps of the gathered inputs
    (training.sp_saved_inputs: shard or gathered)."""
    return plan.training.sp_saved_inputs if any(st.sequence_parallel for st in plan.pipeline.stages) else "off"


def describe_plan(plan: Plan) -> str:
    m, t, mesh, p = plan.model, plan.training, plan.mesh, plan.pipeline
    recs = sorted({r for st in p.stages for r, l in zip(st.recompute, range(st.start, st.end))
                   if m.layer_kind(l) == "block"})
    if "selective" in recs and t.selective_recompute == "ops":  # torchtitan's per-op policy (planner.sac)
        recs = [r if r != "selective" else "selective (per op)" for r in recs]
    zeros = sorted({st.zero for st in p.stages})
    sp = sp_mode(plan)
    split = " | ".join(f"{st.start}-{st.end - 1}" for st in p.stages)
    hsdp = f" (HSDP: {mesh.dp_replicate} replicas x {mesh.dp_shard} shards)" if mesh.dp_replicate > 1 else ""
    active = f", {m.active_parameters() / 1e9:,.2f} B active" if m.moe is not None else ""
    return (f"{m.name} ({m.num_parameters() / 1e9:,.2f} B params{active}) on {plan.cluster.nodes} x "
            f"{plan.cluster.devices_per_node} {plan.cluster.device} ({plan.cluster.name})\n"
            f"mesh pp={mesh.pp} dp={mesh.dp}{hsdp}{f' cp={mesh.cp}' if mesh.cp > 1 else ''} tp={mesh.tp}"
            f"{f' ep={mesh.ep}' if mesh.ep > 1 else ''} (order {'-'.join(mesh.order)}), "
            f"schedule {p.schedule} v={p.virtual_stages}, {p.micro_batches} micro-batches of {t.micro_batch} "
            f"x {t.seq_len} tokens, global batch {t.global_batch}, {t.dtype}"
            f"{f' (FP8 linears, {t.fp8})' if t.fp8 else ''}{_dropout(t)}"
            f"{', documents masked' if t.document_mask else ''}{', positions reset' if t.reset_position_ids else ''}"
            f"{', no loss after end of text' if t.eod_mask_loss else ''}"
            f"{f', load-balancing loss {t.moe_aux_loss:g}' if t.moe_aux_loss else ''}"
            f"{f', busiest expert {t.moe_load_factor:g}x the mean' if t.moe_load_factor != 1 else ''}\n"
            f"zero {','.join(map(str, zeros))}, recompute {','.join(recs) or 'none'}, "
            f"sequence parallel {'off' if sp == 'off' else f'on (keeps {sp} inputs)'}; stages (layers): {split}"
            + _lr_schedule(t))


def _dropout(t) -> str:
    """The plan's dropout, where it has some (training.dropout, attention_dropout)."""
    if not t.dropout and not t.attention_dropout_p:
        return ""
    return (f", dropout {t.dropout:g}" if t.attention_dropout_p == t.dropout
            else f", dropout {t.dropout:g} (attention {t.attention_dropout_p:g})")


def _lr_schedule(t) -> str:
    """A line on the plan's learning-rate schedule, where it has one (planner.plan.Training)."""
    if not t.lr_scheduled:
        return ""
    warm = f", warm-up {t.lr_warmup_steps} steps" if t.lr_warmup_steps else ""
    decay = f", {t.lr_decay} decay to {t.min_lr:g} at step {t.lr_decay_steps}" if t.lr_decay != "constant" else ""
    return f"\nlearning rate {t.lr:g}{warm}{decay}"


def estimate_table(est: Estimate) -> str:
    tb = est.breakdown["time"]
    rows = [
        ("step time", f"{est.step_time_s:.4g} s"),
        ("  compute", f"{tb['compute_s']:.4g} s"),
        ("  TP communication", f"{tb['tp_comm_s']:.4g} s"),
        *([("  CP communication (K/V gathers)", f"{tb['cp_comm_s']:.4g} s")] if "cp_comm_s" in tb else []),
        *([("  EP communication (all-to-all)", f"{tb['ep_comm_s']:.4g} s")] if "ep_comm_s" in tb else []),
        ("  DP/FSDP communication (exposed)", f"{tb['dp_comm_exposed_s']:.4g} s"),
        ("  FSDP buffer copies", f"{tb.get('fsdp_copy_s', 0.0):.4g} s"),
        ("  pipeline bubble", f"{tb['pipeline_bubble_s']:.4g} s"),
        ("  pipeline p2p (exposed)", f"{tb['p2p_s']:.4g} s"),
        ("  optimizer", f"{tb['optimizer_s']:.4g} s"),
    ]
    if "compute_slots" in tb:  # processes sharing CPU cores
        rows.append(("  devices share compute units", f"{tb['compute_slots']:.3g}"))
    rows += [
        ("tokens/s", f"{est.tokens_per_s:,.0f}"),
        ("model TFLOP/s per GPU", f"{est.model_tflops_per_gpu:.1f}"),
        ("MFU", f"{est.mfu:.1%}"),
    ]
    if est.hfu > est.mfu * (1 + 1e-9):  # recomputation executes more than the model counts
        rows += [("  with recomputation (HFU)", f"{est.hfu:.1%}, {est.hardware_tflops_per_gpu:.1f} TFLOP/s per GPU")]
    mb = est.breakdown["memory"]
    rows += [
        (f"peak memory per GPU (pp rank {mb['pp_rank']}"
         + (", at the end of the backward)" if mb.get("peak_at") == "end of backward" else ")"),
         _fmt_bytes(est.peak_memory_bytes)),
        ("  parameters", _fmt_bytes(mb["parameters_bytes"])),
        ("  gradients", _fmt_bytes(mb["gradients_bytes"])),
        ("  optimizer state", _fmt_bytes(mb["optimizer_bytes"])),
        ("  activations", _fmt_bytes(mb["activations_bytes"])),
        ("  other (buffers, transients)", _fmt_bytes(mb["other_bytes"])),
        *((f"    {OTHER_LABELS[k]}", _fmt_bytes(v)) for k, v in mb.get("other_parts", {}).items() if v),
        ("required with allocator reserve", _fmt_bytes(est.required_bytes)),
        ("device memory limit", _fmt_bytes(est.memory_limit_bytes)),
        ("fits", "yes" if est.fits else "NO"),
    ]
    df = pd.DataFrame(rows, columns=["quantity", "value"])
    width = int(df["quantity"].str.len().max())
    return "\n".join(f"{q.ljust(width)}  {v.rjust(14)}" for q, v in df.itertuples(index=False))


OTHER_LABELS = {"fsdp_buffers": "DP/FSDP2, held all step", "fsdp_gathers": "DP/FSDP2 gathers, reductions",
                "replicated_gradients": "DP gradient copies", "pipeline_receive_buffers": "pipeline transfers",
                "tied_embedding_gradients": "tied embedding gradients", "loss_logits": "loss logits",
                "recompute_replay": "recompute replay", "gradient_accumulation": "gradient accumulation",
                "activation_gradients": "activation gradients", "fp8_weight_copies": "FP8 weight copies"}

TIME_TERMS = (("compute_s", "compute"), ("tp_comm_s", "TP comm"), ("dp_comm_exposed_s", "DP/FSDP comm"),
              ("fsdp_copy_s", "FSDP copies"), ("pipeline_bubble_s", "bubble"), ("p2p_s", "p2p"),
              ("optimizer_s", "optimizer"), ("runtime_sync_s", "step sync"), ("pipeline_overhead_s", "pipeline ops"))


def plot_estimate(plan: Plan, est: Estimate, path, device=None) -> None:
    """A picture of a plan's prediction: the step time's terms, the peak memory of each pipeline
    rank against what the device leaves for it (its memory less what is held outside the allocator
    and the allocator's reserve, when `device` is given), and the played pipeline timeline
    (estimate(..., keep_timeline=True))."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from planner.compare import draw_timeline
    tb = est.breakdown["time"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4), gridspec_kw={"width_ratios": [1.2, 1.2, 2.6]})
    ax, left = axes[0], 0.0
    for i, (key, label) in enumerate(TIME_TERMS):
        v = tb.get(key, 0.0)
        if v > 0:
            ax.barh(0, v, left=left, color=f"C{i}", label=f"{label} {v:.3g} s")
            left += v
    ax.set_yticks([])
    ax.set_xlabel("seconds (critical pipeline rank)")
    ax.set_title(f"step {est.step_time_s:.4g} s, MFU {est.mfu:.1%}")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=2)
    ax = axes[1]
    per_rank = est.breakdown.get("memory_per_pp_rank") or [est.peak_memory_bytes]
    ax.bar(range(len(per_rank)), [b / GiB for b in per_rank], color="tab:blue")
    ax.set_xticks(range(len(per_rank)))
    ax.axhline(est.memory_limit_bytes / GiB, color="tab:red", linestyle="--", label="device memory")
    if device is not None:
        usable = (est.memory_limit_bytes - device.reserved_bytes) / (1 + device.allocator_overhead_fraction)
        ax.axhline(usable / GiB, color="tab:orange", linestyle=":", label="less runtime and allocator reserve")
    ax.set_xlabel("pipeline rank")
    ax.set_ylabel("peak memory (GiB)")
    ax.set_title("peak memory per pipeline rank" + ("" if est.fits else " (does not fit)"))
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.25))
    draw_timeline(axes[2], est.timeline)
    m = plan.mesh
    fig.suptitle(f"{plan.model.name}: tp {m.tp} x pp {m.pp} x dp {m.dp}, {plan.pipeline.schedule}, "
                 f"{plan.pipeline.micro_batches} micro-batches of {plan.training.micro_batch}", fontsize=10)
    fig.tight_layout()
    save_figure(fig, path)


def save_figure(fig, path) -> None:
    """Write a --plot picture and close it; a path that cannot be written (a directory, a
    read-only place) is a ConfigError naming --plot."""
    import matplotlib.pyplot as plt
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise ConfigError(f"--plot: cannot write {path} ({exc.strerror or exc}); give a writable file path") from None
    finally:
        plt.close(fig)
