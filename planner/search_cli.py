"""`trident search`: the fastest plans that fit, as a table, JSON or a plan file; with several
cluster sizes, the best of each side by side (planner.sizing)."""
from __future__ import annotations

import json
import sys
from dataclasses import replace

from planner import sizing
from planner.cli import GiB, _check_plot, _cluster_for, _model_profile, _plot, _prediction_dict, sized
from planner.cluster import load_cluster
from planner.cost import estimate
from planner.hsdp import HSDP_POOL, with_hsdp
from planner.model import ConfigError
from planner.model_files import load_model
from planner.report import describe_plan, estimate_table, sp_mode
from planner.sp_modes import EITHER, search_either
from planner.training_args import dropout_note, pipeline_settings, training_settings


def _search_row(i, found) -> dict:
    plan, est = found.plan, found.estimate
    m, mesh, p = plan.model, plan.mesh, plan.pipeline
    blocks = [plan.recompute_of_layer(i) for i in range(1, m.layers + 1)]
    rec = ",".join(f"{mode}:{blocks.count(mode)}" for mode in ("none", "selective", "full") if blocks.count(mode))
    dp = f"{mesh.dp_replicate}x{mesh.dp_shard}" if mesh.dp_replicate > 1 else str(mesh.dp)  # HSDP: replicas x shards
    dp += f" ep{mesh.ep}" if mesh.ep > 1 else ""  # experts spread over ep of the dp ranks (planner.moe)
    return {"#": i, "tp": mesh.tp, "pp": mesh.pp, "dp": dp, "cp": mesh.cp, "order": "-".join(mesh.order),
            "schedule": p.schedule + (f" v={p.virtual_stages}" if p.virtual_stages > 1 else ""),
            "micro-batch": f"{plan.training.micro_batch}x{p.micro_batches}",
            "zero": ",".join(str(z) for z in sorted({st.zero for st in p.stages})),
            "sp": sp_mode(plan), "recompute": rec,
            "step s": f"{est.step_time_s:.4g}", "tokens/s": f"{est.tokens_per_s:,.0f}", "MFU": f"{est.mfu:.1%}",
            "peak GiB": _gib(est.peak_memory_bytes), "needs GiB": _gib(est.required_bytes)}


def _gib(nbytes: float) -> str:
    """GiB to one decimal, or to three significant digits under 1 GiB (a CPU model's MiB show)."""
    v = nbytes / GiB
    return f"{v:.1f}" if v >= 1 else f"{v:.3g}"


def _search_space(args):
    """The choices the search may make, narrowed by the command line's constraints."""
    from planner.search import SearchSpace
    space = SearchSpace()
    for field, arg in (("tp", "tp"), ("pp", "pp"), ("dp", "dp"), ("cp", "cp"), ("micro_batch", "micro_batch"),
                       ("schedules", "schedule"), ("virtual_stages", "virtual_stages"), ("zero", "zero"),
                       ("recompute", "recompute"), ("ep", "ep")):
        if getattr(args, arg) is not None:
            space = replace(space, **{field: getattr(args, arg)})
    if args.virtual_stages is not None and args.schedule is not None and "interleaved-1f1b" not in args.schedule:
        raise ConfigError("--virtual-stages: model chunks per rank are for --schedule interleaved-1f1b, which "
                          f"--schedule {','.join(args.schedule)} leaves out; add it or drop --virtual-stages")
    if args.defer_grad_sync and args.schedule is not None and set(args.schedule) == {"zbv"}:
        raise ConfigError("--defer-grad-sync: not with --schedule zbv, whose split backward reduces each "
                          "micro-batch's weight gradients; add another schedule or drop --defer-grad-sync")
    if args.sequence_parallel is not None:
        space = replace(space, sequence_parallel=(args.sequence_parallel == "on",))
    if args.even_stages:
        space = replace(space, uneven=False)
    if args.thorough:
        space = replace(space, thorough=True)
    if args.dp_replicate is not None:  # HSDP's replica counts searched with the rest (planner.hsdp)
        space = replace(space, dp_replicate=None if args.dp_replicate == "all" else tuple(args.dp_replicate))
    return space


def _constraints_given(args) -> str:
    """The search constraints on the command line, as typed."""
    parts = []
    for arg in ("tp", "pp", "dp", "cp", "dp_replicate", "ep", "micro_batch", "schedule", "virtual_stages", "zero",
                "recompute", "sequence_parallel"):
        v = getattr(args, arg)
        if v is not None:
            parts.append(f"--{arg.replace('_', '-')} " + (v if isinstance(v, str) else ",".join(str(x) for x in v)))
    if args.even_stages:
        parts.append("--even-stages")
    return " ".join(parts)


def _dropout_note(args) -> None:
    """training_args.dropout_note, once the search has found its plans."""
    if note := dropout_note(args):
        print(f"trident: note: {note}", file=sys.stderr)


def cmd_search(args) -> int:
    import time
    _check_plot(args)
    from functools import partial

    from planner.search import search, search_profiled

    if args.document_mask and any(c > 1 for c in args.cp or ()):
        raise ConfigError("--cp: a document mask is a dense s x s mask, which context parallelism does not take; "
                          "leave --cp out or drop --document-mask")
    sizes = args.gpus or args.nodes
    names = args.cluster.split(",")
    if len(sizes) > 1 or len(names) > 1:
        sizing.check_sizes(args, len(sizes), len(names))
        bases = [load_cluster(name) for name in names]
        dup = next((c.name for i, c in enumerate(bases) if c.name in {b.name for b in bases[:i]}), None)
        if dup:
            raise ConfigError(f"--cluster: two of these profiles are named {dup}; give each cluster once, "
                              "with distinct names (`trident cluster derive --name`)")
    else:
        args.gpus, args.nodes, sizes = args.gpus and sizes[0], args.nodes and sizes[0], None
    model = load_model(args.model)
    if args.ep is not None and model.moe is None and args.ep != [1]:
        raise ConfigError(f"--ep: expert parallelism is for mixture-of-experts models; {model.name} has no experts")
    cluster = _cluster_for(args) if sizes is None else None
    limit = args.memory_limit * GiB if args.memory_limit else None
    t0, shown, tty = time.perf_counter(), [0.0], sys.stderr.isatty()

    def progress(done, total, best):  # on a terminal, one self-overwriting line once past a second
        now = time.perf_counter() - t0
        if tty and now > 1.0 and now - shown[0] >= 0.5:
            shown[0] = now
            b = f", best {best:.4g} s" if best else ""
            print(f"\rsearching: {done} of {total} configurations partitioned{b} ({now:.0f} s)  ",
                  end="", file=sys.stderr, flush=True)

    mp = _model_profile(args)
    training = dict(training_settings(args), **pipeline_settings(args))

    def run_search(cluster, top=args.top):
        # HSDP is priced on the plans found (planner.hsdp): on at least HSDP_POOL of them, so that a
        # smaller --top gives the same best plan; with --dp-replicate the search also searches the
        # replica counts, and the pass tries each plan's assignment under the others
        pool = top if args.dp_replicate == (1,) else max(top, HSDP_POOL)  # (1,): flat alone
        kw = dict(global_batch=args.global_batch, seq_len=args.seq_len, memory_limit_bytes=limit, dtype=args.dtype,
                  top=pool, progress=progress, space=_search_space(args), **training)
        # with a model profile, partitioned by the measured layers and ranked by the whole profile
        run = partial(search_profiled, model, cluster, mp) if mp is not None else partial(search, model, cluster)
        res = (search_either(run, **kw) if args.sp_saved_inputs == EITHER
               else run(sp_saved_inputs=args.sp_saved_inputs, **kw))
        t = time.perf_counter()
        allowed = None if args.dp_replicate in (None, "all") else args.dp_replicate
        res.results = with_hsdp(res.results, cluster, limit, mp, allowed)[:top]  # planner.hsdp
        res.elapsed_s += time.perf_counter() - t
        if shown[0]:
            print("\r\033[K", end="", file=sys.stderr, flush=True)
            shown[0] = 0.0
        return res

    if sizes is not None:  # several clusters or sizes: the best plan of each, side by side
        found = sizing.search_sizes(bases, "nodes" if args.nodes else "gpus", sizes, sized, run_search)
        _dropout_note(args)
        return sizing.report(args, model, found, _search_row, _prediction_dict)
    res = run_search(cluster)
    if res.best is None:
        lim = limit if limit is not None else cluster.device.memory_bytes
        need = (f"; the least memory a plan needs is {res.min_required_bytes / GiB:.1f} GiB per device"
                if res.min_required_bytes else "")
        given = _constraints_given(args)
        gpus = cluster.world_size
        print(f"trident: error: no plan of {model.name} fits in {lim / GiB:.3g} GiB per device on {gpus} "
              f"GPU{'s' * (gpus > 1)} with global batch {args.global_batch}" + (f" under {given}" if given else "") + need
              + ("; lift a constraint" if given else "; add GPUs (--gpus, --nodes) or lower --seq-len"),
              file=sys.stderr)
        return 3
    _dropout_note(args)
    for f in res.results:
        f.plan.prediction = _prediction_dict(f.estimate)
    best = res.best
    if args.output:
        best.plan.write(args.output)
    if args.json:
        out = best.estimate.to_dict()
        out["alternatives"] = [{"degrees": {"tp": f.plan.mesh.tp, "pp": f.plan.mesh.pp, "dp": f.plan.mesh.dp,
                                            "cp": f.plan.mesh.cp,
                                            "dp_replicate": f.plan.mesh.dp_replicate, "ep": f.plan.mesh.ep,
                                            "order": f.plan.mesh.order, "schedule": f.plan.pipeline.schedule,
                                            "virtual_stages": f.plan.pipeline.virtual_stages,
                                            "micro_batch": f.plan.training.micro_batch,
                                            "micro_batches": f.plan.pipeline.micro_batches},
                                "estimate": f.estimate.to_dict()} for f in res.results[1:]]
        print(json.dumps(out, indent=2))
        _plot_best(args, cluster, limit, mp, best)
        return 0
    import pandas as pd
    table = pd.DataFrame([_search_row(i + 1, f) for i, f in enumerate(res.results)])
    if (table["cp"] == 1).all():  # no context parallelism among them: no column
        table = table.drop(columns="cp")
    print(describe_plan(best.plan))
    print()
    print(estimate_table(best.estimate))
    print()
    print(table.to_string(index=False))
    print(f"\nsearched {res.configs} configurations ({res.expanded} partitioned, {res.priced} priced) in {res.elapsed_s:.2f} s")
    if args.output:
        print(f"wrote {args.output}")
    _plot_best(args, cluster, limit, mp, best)
    return 0


def _plot_best(args, cluster, limit, mp, best) -> None:
    """The picture of the best plan: its estimate again, keeping the played timeline."""
    if args.plot:
        _plot(args, best.plan, estimate(best.plan, cluster, memory_limit_bytes=limit, model_profile=mp,
                                        keep_timeline=True), cluster)
