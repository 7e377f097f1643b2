"""Cluster sizing: `trident search` over several sizes at once (`--gpus 8,16,32` or `--nodes
1,2,4`), on one cluster or several (`--cluster a,b`), the fastest plan that fits at each, side by
side, for a user choosing how many GPUs, and which, to ask for. The global batch stays as given,
so per-GPU throughput against the first row that fits is the strong-scaling efficiency (across
clusters: the per-GPU speed-up), and GPU-hours per billion tokens what the step costs in device
time. Each search keeps `--top` plans as a search of one size does, so that each row's plan is
the one that search finds (the search's keys are not all bounds: planner.search)."""
from __future__ import annotations

import json
import sys

from planner.model import ConfigError

GiB = 2**30
PLACEHOLDERS = {"sizes": "{gpus}", "clusters": "{cluster}"}
COLUMNS = ("GPUs", "nodes", "tp", "pp", "dp", "schedule", "micro-batch", "zero", "recompute", "step s", "tokens/s",
           "per GPU vs first", "MFU", "GPU-h per 1B tokens", "days per 1T tokens", "peak GiB", "needs GiB")


def check_sizes(args, sizes: int, clusters: int) -> None:
    """What a search of several sizes or clusters cannot do, refused before any search runs."""
    for what, n in (("sizes", sizes), ("clusters", clusters)):
        ph = PLACEHOLDERS[what]
        if args.output and n > 1 and ph not in args.output:
            raise ConfigError(f"-o: {args.output} would be written once per {what[:-1]}; put {ph} in the name, "
                              f"e.g. plan-{ph}.json")


def search_sizes(bases, per: str, sizes, sized, run_search) -> list[dict]:
    """Per cluster of `bases` and size of `sizes` (GPUs or nodes, `per`): the cluster at that size
    (`sized(base, gpus=n)` or `nodes=n`) and its search result (`run_search(cluster)`); where
    the size does not suit the cluster or the constraints admit no configuration there, its
    "error" instead (the one line), unless no size admits any."""
    out = []
    for base in bases:
        for n in sizes:
            f = dict(name=base.name, gpus=n if per == "gpus" else n * base.devices_per_node,
                     nodes=n if per == "nodes" else None, cluster=None, result=None, error=None)
            try:
                f["cluster"] = sized(base, **{per: n})
                f["gpus"], f["nodes"] = f["cluster"].world_size, f["cluster"].nodes
                f["result"] = run_search(f["cluster"])
            except ConfigError as exc:  # e.g. --dp 16 on 8 GPUs: that size is out, the others stand
                f["error"] = str(exc)
            out.append(f)
    if all(f["error"] for f in out):
        raise ConfigError(f"no size admits a configuration under these constraints; at {out[0]['gpus']} GPUs"
                          f"{_of(out, out[0])}: {out[0]['error']}")
    return out


def _several_clusters(found) -> bool:
    return len({f["name"] for f in found}) > 1


def _of(found, f) -> str:
    return f" of {f['name']}" if _several_clusters(found) else ""


def scaling(found) -> list[dict | None]:
    """Per size whose search found a plan: its per-GPU throughput against the first such size,
    GPU-hours per billion tokens and days per trillion tokens at the predicted rate (no failures
    or restarts counted); None for the others."""
    base, out = None, []
    for f in found:
        best = f["result"] and f["result"].best
        if best is None:
            out.append(None)
            continue
        tokens_per_s = best.estimate.tokens_per_s
        per_gpu = tokens_per_s / f["gpus"]
        base = base or per_gpu
        out.append({"per_gpu_vs_first": per_gpu / base, "gpu_hours_per_billion_tokens": 1e9 / per_gpu / 3600,
                    "days_per_trillion_tokens": 1e12 / tokens_per_s / 86400})
    return out


def columns(found) -> tuple:
    cols = COLUMNS
    if any(f["result"] and f["result"].best and f["result"].best.plan.mesh.cp > 1 for f in found):
        # context parallelism in some size's plan: its column
        cols = cols[:cols.index("dp") + 1] + ("cp",) + cols[cols.index("dp") + 1:]
    return (("cluster",) if _several_clusters(found) else ()) + cols


def rows(found, describe) -> list[dict]:
    """Table rows: each size's best plan (`describe(i, found)`: the search table's columns) and
    its scaling figures; where nothing fits, the least memory a plan needs (with the allocator's
    reserve); where the constraints rule the size out, "excluded"."""
    out, cols = [], columns(found)
    for f, scale in zip(found, scaling(found)):
        res = f["result"]
        row = {"cluster": f["name"], "GPUs": f["gpus"], "nodes": f["nodes"] or "-"}
        if f["error"]:
            out.append({c: row.get(c, "-") for c in cols} | {"step s": "excluded"})
            continue
        if res.best is None:
            need = res.min_required_bytes
            row.update({"step s": "no fit", "needs GiB": f"{need / GiB:.1f}" if need else "?"})
            out.append({c: row.get(c, "-") for c in cols})
            continue
        est = res.best.estimate
        d = describe(1, res.best)
        row.update({k: d[k] for k in ("tp", "pp", "dp", "cp", "schedule", "micro-batch", "zero", "recompute")})
        row.update({"step s": f"{est.step_time_s:.4g}", "tokens/s": f"{est.tokens_per_s:,.0f}",
                    "per GPU vs first": f"{scale['per_gpu_vs_first']:.2f}", "MFU": f"{est.mfu:.1%}",
                    "GPU-h per 1B tokens": f"{scale['gpu_hours_per_billion_tokens']:,.1f}",
                    "days per 1T tokens": f"{scale['days_per_trillion_tokens']:,.1f}",
                    "peak GiB": d["peak GiB"], "needs GiB": d["needs GiB"]})
        out.append({c: row[c] for c in cols})
    return out


def as_json(found) -> list[dict]:
    out = []
    for f, scale in zip(found, scaling(found)):
        head = {"cluster": f["name"], "gpus": f["gpus"], "nodes": f["nodes"]}
        if f["error"]:
            out.append({**head, "fits": False, "error": f["error"]})
            continue
        best, res = f["result"].best, f["result"]
        out.append({**head, "fits": best is not None,
                    "min_required_bytes": res.min_required_bytes if best is None else best.estimate.required_bytes,
                    "degrees": None if best is None else {"tp": best.plan.mesh.tp, "pp": best.plan.mesh.pp,
                                                          "dp": best.plan.mesh.dp, "cp": best.plan.mesh.cp,
                                                          "schedule": best.plan.pipeline.schedule,
                                                          "micro_batch": best.plan.training.micro_batch},
                    **(scale or {}), "estimate": None if best is None else best.estimate.to_dict()})
    return out


def report(args, model, found, describe, prediction) -> int:
    """Print the sizes (a table, or JSON with --json), write each best plan where -o asks; 0 when
    a plan fits at some size, else one line and 3."""
    written = []
    for f in found:
        best = f["result"] and f["result"].best
        if best is not None:
            best.plan.prediction = prediction(best.estimate)
            if args.output:
                path = args.output.replace(PLACEHOLDERS["sizes"], str(f["gpus"])).replace(
                    PLACEHOLDERS["clusters"], f["name"])
                best.plan.write(path)
                written.append(path)
    where = "cluster and size" if _several_clusters(found) else "size"
    if args.json:
        print(json.dumps({"sizes": as_json(found)}, indent=2))
    else:
        import pandas as pd
        print(f"{model.name}, global batch {args.global_batch}: the fastest plan that fits at each {where}")
        print(pd.DataFrame(rows(found, describe), columns=columns(found)).to_string(index=False))
        for f in found:
            if f["error"]:
                print(f"excluded, {f['gpus']} GPUs{_of(found, f)}: {f['error']}")
        for path in written:
            print(f"wrote {path}")
    if args.plot:
        plot_sizes(found, args.plot, f"{model.name}, global batch {args.global_batch}",
                   args.memory_limit * GiB if args.memory_limit else None)
        if not args.json:
            print(f"wrote {args.plot}")
    if any(f["result"] and f["result"].best is not None for f in found):
        return 0
    print(f"trident: error: no plan of {model.name} fits at any of these {where}s with global batch "
          f"{args.global_batch}; add larger sizes or lower --seq-len", file=sys.stderr)
    return 3


def plot_sizes(found, path, title: str, limit_bytes: float | None = None) -> None:
    """A picture of the sizes: predicted tokens/s against GPUs beside perfect scaling from the
    first size that fits (a line a cluster), per-GPU throughput against the first row that fits,
    and each size's memory needed against the limit (`limit_bytes`, default its device's; where
    nothing fits, the least a plan needs)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    several = _several_clusters(found)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    first = next((f["result"].best.estimate.tokens_per_s / f["gpus"] for f in found
                  if f["result"] and f["result"].best), None)
    gpus = sorted({f["gpus"] for f in found})
    for name in dict.fromkeys(f["name"] for f in found):
        fits = [(f["gpus"], f["result"].best.estimate) for f in found
                if f["name"] == name and f["result"] and f["result"].best]
        if not fits:
            continue
        g0, e0 = fits[0]
        label = f"{name}: " if several else ""
        line = axes[0].plot([g for g, _ in fits], [e.tokens_per_s for _, e in fits], "o-", label=f"{label}predicted")
        axes[0].plot([g for g, _ in fits], [e0.tokens_per_s * g / g0 for g, _ in fits], "--",
                     color=line[0].get_color(), alpha=0.5, label=f"{label}linear from {g0} GPUs")
        axes[1].plot([g for g, _ in fits], [e.tokens_per_s / g / first for g, e in fits], "o-", label=name)
    axes[0].set_title("tokens/s")
    axes[0].legend(fontsize=7)
    axes[1].axhline(1.0, color="gray", linestyle="--")
    axes[1].set_title("per-GPU throughput against the first row that fits")
    if several:
        axes[1].legend(fontsize=7)
    ax = axes[2]
    need = [f["result"].best.estimate.required_bytes if f["result"] and f["result"].best
            else (f["result"].min_required_bytes if f["result"] else 0.0) or 0.0 for f in found]
    ax.bar(range(len(found)), [n / GiB for n in need],
           color=["tab:blue" if f["result"] and f["result"].best else "tab:gray" for f in found])
    labels = [f"{f['name']}\n{f['gpus']}" if several else str(f["gpus"]) for f in found]
    ax.set_xticks(range(len(found)), labels)
    if several:
        ax.tick_params(axis="x", labelsize=7, labelrotation=30)
    for i, f in enumerate(found):  # each bar's limit: its device's memory unless --memory-limit
        lim = limit_bytes or (f["cluster"].device.memory_bytes if f["cluster"] else None)
        if lim:
            ax.hlines(lim / GiB, i - 0.45, i + 0.45, color="tab:red", linestyle="--",
                      label="memory limit" if i == 0 else None)
    ax.set_title("memory needed per GPU (gray: the least, no plan fits)")
    ax.set_ylabel("GiB")
    ax.legend(fontsize=7)
    for a in axes[:2]:
        a.set_xscale("log", base=2)
        a.set_xticks(gpus, [str(g) for g in gpus])
        a.set_xlabel("GPUs")
    axes[2].set_xlabel("cluster, GPUs" if several else "GPUs")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    from planner.report import save_figure
    save_figure(fig, path)
