"""Cluster sizing: `trident search` over several sizes at once (`--gpus 8,16,32` or `--nodes
1,2,4`), the fastest plan that fits at each, side by side, for a user choosing how many GPUs to
ask for. The global batch stays as given, so per-GPU throughput against the smallest size that
fits is the strong-scaling efficiency, and GPU-hours per billion tokens what the step costs in
device time."""
from __future__ import annotations

import json
import sys

from planner.model import ConfigError

GiB = 2**30
PLACEHOLDER = "{gpus}"
COLUMNS = ("GPUs", "nodes", "tp", "pp", "dp", "schedule", "micro-batch", "zero", "recompute", "step s", "tokens/s",
           "per GPU vs first", "MFU", "GPU-h per 1B tokens", "days per 1T tokens", "peak GiB", "needs GiB")


def check_sizes(args) -> None:
    """What a search of several sizes cannot do, refused before any search runs."""
    if args.output and PLACEHOLDER not in args.output:
        raise ConfigError(f"-o: {args.output} would be written once per size; put {PLACEHOLDER} in the name, "
                          f"e.g. plan-{PLACEHOLDER}.json")


def search_sizes(clusters, run_search) -> list[dict]:
    """Per cluster: its search result (`run_search(cluster)`); where the constraints admit no
    configuration at a size, its "error" instead (the search's one line), unless they admit none
    at any."""
    out = []
    for cluster in clusters:
        try:
            out.append(dict(cluster=cluster, result=run_search(cluster), error=None))
        except ConfigError as exc:  # e.g. --dp 16 on 8 GPUs: that size is out, the others stand
            out.append(dict(cluster=cluster, result=None, error=str(exc)))
    if all(f["error"] for f in out):
        raise ConfigError(f"no size admits a configuration under these constraints; at {out[0]['cluster'].world_size}"
                          f" GPUs: {out[0]['error']}")
    return out


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
        per_gpu = tokens_per_s / f["cluster"].world_size
        base = base or per_gpu
        out.append({"per_gpu_vs_first": per_gpu / base, "gpu_hours_per_billion_tokens": 1e9 / per_gpu / 3600,
                    "days_per_trillion_tokens": 1e12 / tokens_per_s / 86400})
    return out


def rows(found, describe) -> list[dict]:
    """Table rows: each size's best plan (`describe(i, found)`: the search table's columns) and
    its scaling figures; where nothing fits, the least memory a plan needs (with the allocator's
    reserve); where the constraints rule the size out, "excluded"."""
    out = []
    for f, scale in zip(found, scaling(found)):
        cluster, res = f["cluster"], f["result"]
        row = {"GPUs": cluster.world_size, "nodes": cluster.nodes}
        if f["error"]:
            out.append({c: row.get(c, "-") for c in COLUMNS} | {"step s": "excluded"})
            continue
        if res.best is None:
            need = res.min_required_bytes
            row.update({"step s": "no fit", "needs GiB": f"{need / GiB:.1f}" if need else "?"})
            out.append({c: row.get(c, "-") for c in COLUMNS})
            continue
        est = res.best.estimate
        d = describe(1, res.best)
        row.update({k: d[k] for k in ("tp", "pp", "dp", "schedule", "micro-batch", "zero", "recompute")})
        row.update({"step s": f"{est.step_time_s:.4g}", "tokens/s": f"{est.tokens_per_s:,.0f}",
                    "per GPU vs first": f"{scale['per_gpu_vs_first']:.2f}", "MFU": f"{est.mfu:.1%}",
                    "GPU-h per 1B tokens": f"{scale['gpu_hours_per_billion_tokens']:,.1f}",
                    "days per 1T tokens": f"{scale['days_per_trillion_tokens']:,.1f}",
                    "peak GiB": d["peak GiB"], "needs GiB": d["needs GiB"]})
        out.append({c: row[c] for c in COLUMNS})
    return out


def as_json(found) -> list[dict]:
    out = []
    for f, scale in zip(found, scaling(found)):
        cluster, res = f["cluster"], f["result"]
        if f["error"]:
            out.append({"gpus": cluster.world_size, "nodes": cluster.nodes, "fits": False, "error": f["error"]})
            continue
        best = res.best
        out.append({"gpus": cluster.world_size, "nodes": cluster.nodes, "fits": best is not None,
                    "min_required_bytes": res.min_required_bytes if best is None else best.estimate.required_bytes,
                    "degrees": None if best is None else {"tp": best.plan.mesh.tp, "pp": best.plan.mesh.pp,
                                                          "dp": best.plan.mesh.dp,
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
                path = args.output.replace(PLACEHOLDER, str(f["cluster"].world_size))
                best.plan.write(path)
                written.append(path)
    if args.json:
        print(json.dumps({"sizes": as_json(found)}, indent=2))
    else:
        import pandas as pd
        print(f"{model.name}, global batch {args.global_batch}: the fastest plan that fits at each size")
        print(pd.DataFrame(rows(found, describe), columns=COLUMNS).to_string(index=False))
        for f in found:
            if f["error"]:
                print(f"excluded, {f['cluster'].world_size} GPUs: {f['error']}")
        for path in written:
            print(f"wrote {path}")
    if args.plot:
        plot_sizes(found, args.plot, f"{model.name}, global batch {args.global_batch}",
                   args.memory_limit * GiB if args.memory_limit else None)
        if not args.json:
            print(f"wrote {args.plot}")
    if any(f["result"] and f["result"].best is not None for f in found):
        return 0
    print(f"trident: no plan of {model.name} fits at any of these sizes with global batch {args.global_batch}; "
          "add larger sizes or lower --seq-len", file=sys.stderr)
    return 3


def plot_sizes(found, path, title: str, limit_bytes: float | None = None) -> None:
    """A picture of the sizes: predicted tokens/s against GPUs beside perfect scaling from the
    first size that fits, per-GPU throughput against it, and each size's memory needed against
    the limit (`limit_bytes`, default the device's; where nothing fits, the least a plan needs)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpus = [f["cluster"].world_size for f in found]
    fits = [(g, f["result"].best.estimate) for g, f in zip(gpus, found) if f["result"] and f["result"].best]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    ax = axes[0]
    if fits:
        g0, e0 = fits[0]
        ax.plot([g for g, _ in fits], [e.tokens_per_s for _, e in fits], "o-", label="predicted")
        ax.plot([g for g, _ in fits], [e0.tokens_per_s * g / g0 for g, _ in fits], "--", color="gray",
                label=f"linear from {g0} GPUs")
        axes[1].plot([g for g, _ in fits], [e.tokens_per_s / g / (e0.tokens_per_s / g0) for g, e in fits], "o-")
    ax.set_title("tokens/s")
    ax.legend(fontsize=7)
    axes[1].axhline(1.0, color="gray", linestyle="--")
    axes[1].set_title("per-GPU throughput against the first size that fits")
    ax = axes[2]
    need = [f["result"].best.estimate.required_bytes if f["result"] and f["result"].best
            else (f["result"].min_required_bytes if f["result"] else 0.0) or 0.0 for f in found]
    ax.bar(range(len(gpus)), [n / GiB for n in need],
           color=["tab:blue" if f["result"] and f["result"].best else "tab:gray" for f in found])
    ax.set_xticks(range(len(gpus)), [str(g) for g in gpus])
    limit = limit_bytes or found[0]["cluster"].device.memory_bytes
    ax.axhline(limit / GiB, color="tab:red", linestyle="--", label="memory limit")
    ax.set_title("memory needed per GPU (gray: the least, no plan fits)")
    ax.set_ylabel("GiB")
    ax.legend(fontsize=7)
    for a in axes[:2]:
        a.set_xscale("log", base=2)
        a.set_xticks(gpus, [str(g) for g in gpus])
        a.set_xlabel("GPUs")
    axes[2].set_xlabel("GPUs")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
