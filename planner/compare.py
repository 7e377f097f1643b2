"""Predicted against measured: a plan's prediction next to the run record the runtime wrote."""
from __future__ import annotations

import statistics
from pathlib import Path

from planner.cost import MAX_PRICED_STEP_S
from planner.model import ConfigError, is_int, is_real
from planner.moe import expert_load
from planner.plan import DTYPES, Plan
from planner.profile_checks import read_json

RUN_KEYS = ("losses", "step_times_s", "warmup_steps", "peak_memory_bytes", "peak_memory_bytes_per_rank")


MAX_STEP_S = 1e6  # a recorded step longer than this is not a measurement
MIN_STEP_S = 1e-9  # nor one shorter than this, recorded or priced (a throughput from it would overflow)
MAX_BYTES = 2.0 ** 64  # nor a byte count above this, measured or predicted


def read_run(path) -> dict:
    """Load a run.json and check the keys compare needs; errors name the file and the key."""
    run = read_json(Path(path), "run")[1]
    if not isinstance(run, dict):
        raise ConfigError(f"run: {path} must hold a JSON object")
    for key in RUN_KEYS:
        if key not in run:
            raise ConfigError(f"run.{key}: missing in {path}; it must be a run record written by runtime.train")
    bad = lambda key, what: ConfigError(f"run.{key}: {run[key]!r} in {path} must be {what}; give the run.json "
                                        "that `trident run` wrote")
    if not _is_count(run["warmup_steps"]):
        raise bad("warmup_steps", "a non-negative integer")
    for key, ok, what in (("step_times_s", lambda x: _is_number(x, 0.0), " above 0"),
                          ("peak_memory_bytes_per_rank", lambda x: _nonneg(x, MAX_BYTES), f" from 0 to {MAX_BYTES:g}"),
                          ("losses", _is_number, "")):
        if not isinstance(run[key], list) or not all(ok(x) for x in run[key]):
            raise bad(key, "a list of numbers" + what)
    if any(not MIN_STEP_S <= x <= MAX_STEP_S for x in run["step_times_s"]):
        raise bad("step_times_s", f"a list of seconds a step, each from {MIN_STEP_S:g} to {MAX_STEP_S:g} (11.6 days)")
    opt = run.get("optimizer_times_s")
    if opt is not None and not (isinstance(opt, list) and all(_nonneg(x) for x in opt)):
        raise bad("optimizer_times_s", "a list of numbers of at least 0 or null")
    if isinstance(opt, list) and len(opt) == len(run["step_times_s"]) and any(
            o > t for o, t in zip(opt, run["step_times_s"])):
        raise bad("optimizer_times_s", "a list of seconds, each at most its step's time in step_times_s")
    if not _nonneg(run["peak_memory_bytes"], MAX_BYTES):
        raise bad("peak_memory_bytes", f"a number of bytes from 0 to {MAX_BYTES:g}")
    if run.get("traced_step_index") is not None and not _is_count(run["traced_step_index"]):
        raise bad("traced_step_index", "a non-negative integer or null")
    if "world_size" in run and not (_is_count(run["world_size"]) and run["world_size"] > 0):
        raise bad("world_size", "a positive integer")
    if run.get("dtype") is not None and not (isinstance(run["dtype"], str) and run["dtype"] in DTYPES):
        raise bad("dtype", f"one of {', '.join(DTYPES)} or null")
    if "host_cores" in run and not (_is_count(run["host_cores"]) and run["host_cores"] > 0):
        raise bad("host_cores", "a positive integer")
    busy, cores = run.get("host_other_busy_cores"), run.get("host_cores")
    if busy is not None and not (_nonneg(busy) and (cores is None or busy <= cores)):
        raise bad("host_other_busy_cores", "a number from 0 to host_cores, or null")
    if run.get("host_compute_slots") is not None and not _is_number(run["host_compute_slots"], 0.0):
        raise bad("host_compute_slots", "a number above 0 or null")
    held = run.get("memory_held_after_step_bytes_per_rank")
    if held is not None and not (isinstance(held, list) and all(
            h is None or (isinstance(h, list) and all(x is None or _nonneg(x) for x in h)) for h in held)):
        raise bad("memory_held_after_step_bytes_per_rank", "a list (one per rank) of lists of bytes, or null")
    waits = run.get("pipeline_wait_times_s_per_rank")
    if waits is not None and not (isinstance(waits, list) and all(
            isinstance(w, list) and len(w) == len(run["step_times_s"]) and all(_nonneg(x) for x in w) for w in waits)):
        raise bad("pipeline_wait_times_s_per_rank", "a list (one per rank) of seconds a step, or null")
    for key in ("moe_load_factor", "moe_rank_load_factor"):
        v = run.get(key)
        if v is not None and not (isinstance(v, list) and all(x is None or _is_number(x) and x >= 1 for x in v)):
            raise bad(key, "a list of numbers of at least 1 (one a step), or null")
    if run.get("memory_step_index") is not None and not _is_count(run["memory_step_index"]):
        raise bad("memory_step_index", "a non-negative integer or null")
    steps = run["step_times_s"]
    if len(steps) <= run["warmup_steps"]:
        raise ConfigError(f"run.step_times_s: {path} has {len(steps)} steps, "
                          f"not more than its {run['warmup_steps']} warm-up steps; run more steps")
    return run


def _is_count(v) -> bool:
    return is_int(v) and v >= 0


def _nonneg(v, top: float = float("inf")) -> bool:
    return is_real(v) and 0 <= v <= top


def _is_number(v, above: float | None = None) -> bool:
    """A finite number (not a bool), greater than `above` when given."""
    return is_real(v) and (above is None or v > above)


def check_prediction(prediction) -> None:
    """The parts of a plan's prediction compare reads; errors say how to get a fresh one."""
    fix = "re-price the plan: pass --cluster-profile (and --model-profile if it was priced with one)"
    if not isinstance(prediction, dict):
        raise ConfigError(f"prediction: {prediction!r} is not an estimate; {fix}")
    for key in ("step_time_s", "peak_memory_bytes"):
        if not (_is_number(prediction.get(key), 0.0) and prediction[key] <= MAX_BYTES):
            raise ConfigError(f"prediction.{key}: {prediction.get(key)!r} must be a number above 0 (bytes: at most "
                              f"{MAX_BYTES:g}); {fix}")
    step = prediction["step_time_s"]
    if not MIN_STEP_S <= step <= MAX_PRICED_STEP_S:
        raise ConfigError(f"prediction.step_time_s: {step!r} must be from {MIN_STEP_S:g} to {MAX_PRICED_STEP_S:g} s; "
                          f"{fix}")
    if not isinstance(prediction.get("breakdown"), dict):
        raise ConfigError(f"prediction.breakdown: {prediction.get('breakdown')!r} must be an object; {fix}")
    time = prediction["breakdown"].get("time", {})
    if not isinstance(time, dict):
        raise ConfigError(f"prediction.breakdown.time: {time!r} must be an object; {fix}")
    mem = prediction["breakdown"].get("memory_per_pp_rank")
    if mem is not None and not (isinstance(mem, list) and all(_nonneg(x, prediction["peak_memory_bytes"]) for x in mem)):
        raise ConfigError(f"prediction.breakdown.memory_per_pp_rank: {mem!r} must be a list of bytes from 0 to "
                          f"peak_memory_bytes; {fix}")
    slots = time.get("compute_slots")
    if slots is not None and not _is_number(slots, 0.0):
        raise ConfigError(f"prediction.breakdown.time.compute_slots: {slots!r} must be a number above 0 or null; {fix}")
    opt = prediction["breakdown"].get("optimizer_per_pp_rank_s")
    if opt is not None and not (isinstance(opt, list) and opt and all(_nonneg(x) and x <= step for x in opt)):
        raise ConfigError(f"prediction.breakdown.optimizer_per_pp_rank_s: {opt!r} must be a list of seconds from 0 to "
                          f"step_time_s; {fix}")
    waits = prediction["breakdown"].get("optimizer_wait_per_pp_rank_s")
    if waits is not None and not (isinstance(waits, list) and all(_nonneg(x) and x <= step for x in waits)):
        raise ConfigError(f"prediction.breakdown.optimizer_wait_per_pp_rank_s: {waits!r} must be a list of seconds "
                          f"from 0 to step_time_s; {fix}")
    opt = time.get("optimizer_s")
    if "optimizer_s" in time and not (_nonneg(opt) and opt <= step):
        raise ConfigError(f"prediction.breakdown.time.optimizer_s: {opt!r} must be seconds from 0 to step_time_s; {fix}")


def compare(plan: Plan, run: dict, prediction: dict) -> dict:
    """Predicted vs measured step time, throughput and peak memory (overall and per pipeline
    stage), each with its signed relative error (predicted - measured) / measured."""
    if run.get("world_size") not in (None, plan.mesh.world_size):
        raise ConfigError(f"run.world_size: {run['world_size']} but the plan has {plan.mesh.world_size} ranks; "
                          "compare a run with the plan it ran")
    per_rank = run["peak_memory_bytes_per_rank"]
    if per_rank and len(per_rank) != plan.mesh.world_size:
        raise ConfigError(f"run.peak_memory_bytes_per_rank: {len(per_rank)} entries but the plan has "
                          f"{plan.mesh.world_size} ranks; compare a run with the plan it ran")
    check_prediction(prediction)
    if run.get("plan_hash") not in (None, plan.content_hash()):
        raise ConfigError("run.plan_hash: this run was made from a different plan; compare it with the plan it ran")
    if run.get("dtype") not in (None, plan.training.dtype):
        raise ConfigError(f"run.dtype: the run computed in {run['dtype']} but the plan is priced for "
                          f"{plan.training.dtype}; rerun it with --dtype {plan.training.dtype} or plan it with "
                          f"--dtype {run['dtype']}")
    timed = [run["step_times_s"][i] for i in _timed_steps(run)]
    measured_step = statistics.median(timed)
    tokens = plan.training.global_batch * plan.training.seq_len
    pred_step = prediction["step_time_s"]
    measured_stage = {pp: max(bs) for pp, bs in _by_stage(plan, per_rank).items()}
    predicted_stage = prediction["breakdown"].get("memory_per_pp_rank") or []
    predicted_wait = prediction["breakdown"].get("optimizer_wait_per_pp_rank_s") or []
    measured_wait = _pipeline_waits(plan, run)
    stages = []
    for pp in range(plan.mesh.pp):
        p = predicted_stage[pp] if pp < len(predicted_stage) else None
        m = measured_stage.get(pp)
        stages.append({"pp_rank": pp, "predicted_peak_memory_bytes": p, "measured_peak_memory_bytes": m,
                       "memory_error": _err(p, m),
                       "predicted_pipeline_wait_s": predicted_wait[pp] if pp < len(predicted_wait) else None,
                       "measured_pipeline_wait_s": measured_wait.get(pp)})
    measured_mem = max(per_rank) if per_rank else run["peak_memory_bytes"]
    slots = prediction["breakdown"].get("time", {}).get("compute_slots")
    return {
        "predicted_step_time_s": pred_step,
        "measured_step_time_s": measured_step,
        "measured_step_time_min_s": min(timed), "measured_step_time_max_s": max(timed),
        "timed_steps": len(timed),
        "step_time_error": _err(pred_step, measured_step),
        "predicted_tokens_per_s": tokens / pred_step, "measured_tokens_per_s": tokens / measured_step,
        "predicted_peak_memory_bytes": prediction["peak_memory_bytes"],
        "measured_peak_memory_bytes": measured_mem,
        "memory_error": _err(prediction["peak_memory_bytes"], measured_mem),
        **_optimizer_terms(run, prediction),
        "stages": stages,
        "final_loss": run["losses"][-1] if run["losses"] else None,
        "host_note": busy_note(run.get("host_other_busy_cores"), run.get("host_cores")),
        # full-speed slots the ranks computed at together (CPU processes sharing cores): priced, measured
        "predicted_compute_slots": slots, "measured_compute_slots": run.get("host_compute_slots"),
        "machine_note": slots_note(run.get("host_compute_slots"), slots),
        "memory_note": leak_note(run),
        **_load_factors(plan, run),
    }


def _load_factors(plan: Plan, run: dict) -> dict:
    """An MoE plan's priced training.moe_load_factor and, under expert parallelism, the busiest EP
    rank's load it prices (planner.moe.expert_load), each beside the run's median of its timed steps."""
    out, moe = {}, plan.model.moe is not None
    for key, priced in (("moe_load_factor", plan.training.moe_load_factor if moe else None),
                        ("moe_rank_load_factor", 1 + expert_load(plan, "block") if moe and plan.mesh.ep > 1 else None)):
        loads = run.get(key) or []
        measured = [loads[i] for i in _timed_steps(run) if i < len(loads) and loads[i] is not None]
        if priced is not None and measured:
            median = statistics.median(measured)
            out.update({f"predicted_{key}": priced, f"measured_{key}": median, f"{key}_error": _err(priced, median)})
    return out


def _timed_steps(run: dict) -> list[int]:
    """Indices of the steps that time the plan: after the warm-up, less the one traced under
    runtime.train --trace (the profiler slows it), unless it is the only one."""
    steps = range(run["warmup_steps"], len(run["step_times_s"]))
    return [i for i in steps if i != run.get("traced_step_index")] or list(steps)


def _pipeline_waits(plan: Plan, run: dict) -> dict:
    """Per pipeline rank, the median over the timed steps of its ranks' longest wait in the gradient
    norm's all-reduce over the pipeline, for the last rank's backward (runtime.train); {} where the
    run did not record it."""
    waits = run.get("pipeline_wait_times_s_per_rank")
    if not waits or len(waits) != plan.mesh.world_size or plan.mesh.pp == 1:
        return {}
    return {pp: statistics.median(max(w[i] for w in ws) for i in _timed_steps(run))
            for pp, ws in _by_stage(plan, waits).items()}


def _by_stage(plan: Plan, per_rank: list) -> dict:
    """Values given one per rank, grouped by the ranks' pipeline rank."""
    out: dict = {}
    for rank, x in enumerate(per_rank):
        out.setdefault(plan.mesh.coords(rank)["pp"], []).append(x)
    return out


def _optimizer_terms(run: dict, prediction: dict) -> dict:
    """The optimizer step (the slowest rank's gradient clipping and AdamW step) and the rest of the
    step, predicted against measured, where the run recorded its optimizer times."""
    opt = run.get("optimizer_times_s")
    if not isinstance(opt, list) or len(opt) != len(run["step_times_s"]):
        return {}
    steps = _timed_steps(run)
    meas_opt = statistics.median(opt[i] for i in steps)
    meas_rest = statistics.median(run["step_times_s"][i] - opt[i] for i in steps)
    # the run times the slowest rank's optimizer step: so does the prediction (the step's own
    # optimizer term is the critical rank's; plans priced before 2026-12-01 have only that)
    per_rank = prediction["breakdown"].get("optimizer_per_pp_rank_s")
    pred_opt = max(per_rank) if per_rank else prediction["breakdown"].get("time", {}).get("optimizer_s", 0.0)
    pred_rest = prediction["step_time_s"] - pred_opt
    return {"predicted_optimizer_s": pred_opt, "measured_optimizer_s": meas_opt,
            "optimizer_error": _err(pred_opt, meas_opt),
            "predicted_forward_backward_s": pred_rest, "measured_forward_backward_s": meas_rest,
            "forward_backward_error": _err(pred_rest, meas_rest)}


def _err(pred, meas):
    if pred is None or not meas:
        return None
    return (pred - meas) / meas


OTHER_LOAD_SHARE = 0.25  # more of the cores than this busy with other work: the timings are a busy machine's


def busy_note(busy_cores, cores) -> str | None:
    """A note when other work kept more than OTHER_LOAD_SHARE of `cores` CPU cores busy while
    trident's processes slept (runtime.host_share.other_load); None if not, or not measured."""
    if busy_cores is None or not cores or busy_cores <= OTHER_LOAD_SHARE * cores:
        return None
    return (f"{busy_cores:.1f} of this machine's {cores} CPU cores were busy with other work while trident's "
            f"processes slept: times measured meanwhile are those of a busy machine; profile and run with the "
            f"machine otherwise idle")


SLOTS_DRIFT = 0.15  # the run's compute_slots this far from the profile's: the machine changed speed


def slots_note(run_slots, profile_slots) -> str | None:
    """A note when the ranks of a run computed together at more than SLOTS_DRIFT away from the
    compute_slots the plan was priced with (the cluster profile's): the machine gave its processes
    another share of its cores than when it was profiled, so the step-time error holds that change
    as well as the model's. None when either is unknown (a GPU run has no sharing to price)."""
    if not run_slots or not profile_slots or abs(run_slots / profile_slots - 1) <= SLOTS_DRIFT:
        return None
    return (f"its processes computed together at {run_slots:.2f} full-speed slots, where the cluster profile "
            f"priced {profile_slots:.2f}: the machine changed speed between profiling and this run (other work, "
            f"or a virtual machine's neighbours), and the step-time error holds that too; profile again right "
            f"before the run")


# a rank holding more after each step than this share of its peak, and than LEAK_FLOOR_BYTES: a
# leak. The floor spares CPU runs of tiny models, whose C heap grows 35-190 KiB a step under gloo
# with TP or data parallelism while c10d's flight recorder fills its ring buffer of collectives
# (bounded: it stopped at step 27 of a 30-step run; with TORCH_FR_BUFFER_SIZE=0, 1-2 KiB a step)
LEAK_SHARE, LEAK_FLOOR_BYTES = 0.02, 2**20


def leak_note(run: dict) -> str | None:
    """A note when a rank held more after each step than after the one before, from the step that
    measured the memory to the last, by more than LEAK_SHARE of its peak (and LEAK_FLOOR_BYTES) a
    step on average: memory that leaks (the peak is one step's; a longer run outgrows it). None
    where the run did not record it (runtime.train's memory_held_after_step_bytes_per_rank) or ran
    no step after that one."""
    held, first = run.get("memory_held_after_step_bytes_per_rank"), run.get("memory_step_index")
    worst = None
    for rank, (h, peak) in enumerate(zip(held or [], run["peak_memory_bytes_per_rank"])):
        if first is None or not h or len(h) <= first + 1 or h[first] is None or h[-1] is None or not peak:
            continue
        grown = (h[-1] - h[first]) / (len(h) - 1 - first)
        if grown > max(LEAK_SHARE * peak, LEAK_FLOOR_BYTES) and (worst is None
                                                                  or grown / peak > worst[1] / worst[2]):
            worst = (rank, grown, peak, len(h))
    if worst is None:
        return None
    rank, grown, peak, steps = worst
    return (f"rank {rank} held {grown / 2**20:,.1f} MiB more after each of steps {first + 2} to {steps} than after the "
            f"one before ({grown / peak:.0%} of its peak a step): memory leaks, and a longer run will outgrow the "
            f"peak measured")


def comparison_table(result: dict) -> str:
    def pct(x):
        return "n/a" if x is None else f"{x:+.1%}"

    mib = 2**20
    rows = [("", "predicted", "measured", "error"),
            ("step time (s, median)", f"{result['predicted_step_time_s']:.4g}", f"{result['measured_step_time_s']:.4g}",
             pct(result["step_time_error"])),
            ("tokens/s", f"{result['predicted_tokens_per_s']:,.0f}", f"{result['measured_tokens_per_s']:,.0f}",
             pct(-result["step_time_error"] / (1 + result["step_time_error"])
                if result["step_time_error"] not in (None, -1.0) else None)),
            *([("  forward + backward (s)", f"{result['predicted_forward_backward_s']:.4g}",
                f"{result['measured_forward_backward_s']:.4g}", pct(result["forward_backward_error"])),
               ("  optimizer step (s)", f"{result['predicted_optimizer_s']:.4g}",
                f"{result['measured_optimizer_s']:.4g}", pct(result["optimizer_error"]))]
              if "measured_optimizer_s" in result else []),
            ("peak memory (MiB)", f"{result['predicted_peak_memory_bytes'] / mib:,.1f}",
             f"{result['measured_peak_memory_bytes'] / mib:,.1f}", pct(result["memory_error"]))]
    for key, what in (("moe_load_factor", "MoE load (busiest expert / mean)"),
                      ("moe_rank_load_factor", "  busiest EP rank / mean")):  # planner.moe.expert_load
        if f"measured_{key}" in result:
            rows.append((what, f"{result[f'predicted_{key}']:.3g}", f"{result[f'measured_{key}']:.3g}",
                         pct(result[f"{key}_error"])))
    for st in result["stages"]:
        p, m = st["predicted_peak_memory_bytes"], st["measured_peak_memory_bytes"]
        rows.append((f"  stage {st['pp_rank']} peak memory (MiB)", "n/a" if p is None else f"{p / mib:,.1f}",
                     "n/a" if m is None else f"{m / mib:,.1f}", pct(st["memory_error"])))
    if any(st.get("measured_pipeline_wait_s") is not None for st in result["stages"]):
        for st in result["stages"]:  # each stage's wait before its optimizer step
            p, m = ("n/a" if x is None else f"{x * 1e3:.3g}"
                    for x in (st["predicted_pipeline_wait_s"], st["measured_pipeline_wait_s"]))
            rows.append((f"  stage {st['pp_rank']} waits for the last backward (ms)", p, m, ""))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    table = "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                      for r in rows)
    return table + "".join(f"\nnote: the run: {result[k]}" for k in ("host_note", "machine_note", "memory_note")
                           if result.get(k))


def plot(result: dict, timeline, path) -> None:
    """Predicted vs measured (step time, memory per stage) and the predicted pipeline timeline."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4), gridspec_kw={"width_ratios": [1, 1.4, 2.6]})
    ax = axes[0]
    ax.bar(["predicted", "measured"], [result["predicted_step_time_s"], result["measured_step_time_s"]],
           color=["tab:blue", "tab:orange"])
    ax.set_ylabel("step time (s)")
    ax.set_title(f"step time ({result['step_time_error']:+.1%})")
    ax = axes[1]
    xs = range(len(result["stages"]))
    mib = 2**20
    ax.bar([x - 0.2 for x in xs], [(s["predicted_peak_memory_bytes"] or 0) / mib for s in result["stages"]],
           width=0.4, label="predicted")
    ax.bar([x + 0.2 for x in xs], [(s["measured_peak_memory_bytes"] or 0) / mib for s in result["stages"]],
           width=0.4, label="measured")
    ax.set_xticks(list(xs), [f"stage {s['pp_rank']}" for s in result["stages"]])
    ax.set_ylabel("peak memory (MiB)")
    ax.set_title("peak memory per pipeline stage")
    ax.legend()
    draw_timeline(axes[2], timeline)
    fig.tight_layout()
    from planner.report import save_figure
    save_figure(fig, path)


def draw_timeline(ax, timeline) -> None:
    """Gantt chart of a played schedule: one row per pipeline rank, forward light, backward dark
    (a split backward's input gradient dark, its weight gradient purple)."""
    if timeline is None:
        ax.set_axis_off()
        return
    colors = {"F": "tab:cyan", "B": "tab:blue", "I": "tab:blue", "W": "tab:purple"}
    for r, ops in enumerate(timeline.ops):
        for o in ops:
            ax.barh(r, o.end_s - o.start_s, left=o.start_s, color=colors[o.kind], edgecolor="white", linewidth=0.3)
            if timeline.micro_batches * timeline.virtual_stages <= 16:
                ax.text((o.start_s + o.end_s) / 2, r, f"{o.kind}{o.micro_batch}", ha="center", va="center", fontsize=6)
        for s, a, b in (timeline.comm_intervals[r] if timeline.comm_intervals else []):
            ax.barh(r + 0.35, b - a, left=a, height=0.15, color="tab:red")
    ax.set_yticks(range(timeline.pp), [f"pp {r}" for r in range(timeline.pp)])
    ax.invert_yaxis()
    ax.set_xlabel("time (s)")
    ax.set_title("predicted pipeline timeline (red: gradient sync)")
