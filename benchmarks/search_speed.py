"""How fast `trident search` is, and how good its plans are against published configurations.

    python benchmarks/search_speed.py [--repeat N] [--case NAME] [--profile] [--sp-saved-inputs MODE] [--flat]
    python benchmarks/search_speed.py --quality [--csv PATH]

Speed: each case runs in a fresh process (so that caches and peak RSS are its own) `--repeat`
times; the table gives the median wall time of the search as `trident search` runs it (asked for
HSDP's pool of 5 flat plans, each then priced split into replicas; `--flat`: the search alone,
asked for --top plans, as `--dp-replicate 1` runs it and as this benchmark timed until session
42) and the peak resident memory of the process (resource.getrusage, ru_maxrss). Targets: llama2-7b on 8 GPUs < 1 s, gpt3-175b on
1024 GPUs < 10 s, llama3-405b on 16384 GPUs < 30 s, peak memory < 2 GiB.

Quality: for every Megatron row of shared/reference/published_runs.csv, the published configuration
priced by benchmarks/published.py (the fastest fitting choice of the settings the row leaves open),
timed as trident's runtime would run it (without the row's framework options: those describe
Megatron-LM's and DeepSpeed's engines, not the runtime the search plans for), against the searched
plan for the same model, cluster, GPU count, global batch, dtype, dropout and attention kernel. The
search must be at least as fast under the same cost model.
"""
from __future__ import annotations

import argparse
import csv
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GiB = 2**30
CASES = {
    "llama2-7b/8": dict(model="llama2-7b", cluster="dgx-a100-80gb", gpus=8, global_batch=16, seq_len=2048,
                        memory_limit=36, target_s=1.0),
    "gpt3-175b/1024": dict(model="gpt3-175b", cluster="dgx-a100-80gb", gpus=1024, global_batch=1536, target_s=10.0),
    "llama3-405b/16384": dict(model="llama3-405b", cluster="dgx-h100-80gb", gpus=16384, global_batch=2048,
                              seq_len=8192, target_s=30.0),
}


def run_case(name: str, repeat: int, top: int, profile: bool, saved: str = "shard", flat: bool = False) -> dict:
    """In this process: search `repeat` times, return the timings, the best plan and peak RSS.
    `saved`: the search's --sp-saved-inputs (either: planner.sp_modes, both modes searched). As
    `trident search --top TOP` does: the search asked for HSDP's pool of flat plans at least
    (planner.hsdp.HSDP_POOL), each priced split into replicas where that beats it; `flat`: the
    search asked for `top` plans alone, no HSDP (`trident search --dp-replicate 1`)."""
    from functools import partial

    from planner.cluster import load_cluster
    from planner.hsdp import HSDP_POOL, with_hsdp
    from planner.model_files import load_model
    from planner.report import sp_mode
    from planner.search import SearchSpace, search
    from planner.sp_modes import EITHER, search_either

    c = CASES[name]
    cluster = load_cluster(c["cluster"])
    cluster = cluster.shaped_as(1, c["gpus"]) if c["gpus"] < cluster.devices_per_node else \
        cluster.with_nodes(c["gpus"] // cluster.devices_per_node)
    model = load_model(c["model"])
    limit = c["memory_limit"] * GiB if c.get("memory_limit") else None
    kw = dict(global_batch=c["global_batch"], seq_len=c.get("seq_len"), memory_limit_bytes=limit,
              top=top if flat else max(top, HSDP_POOL))
    if saved == EITHER:
        flat_run = partial(search_either, partial(search, model, cluster), space=SearchSpace(), **kw)
    else:
        flat_run = partial(search, model, cluster, sp_saved_inputs=saved, **kw)

    def run():  # planner.search_cli's run_search
        res = flat_run()
        if not flat:
            res.results = with_hsdp(res.results, cluster, limit)[:top]
        return res
    times, res = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        if profile:
            import cProfile
            import pstats
            prof = cProfile.Profile()
            res = prof.runcall(run)
            pstats.Stats(prof, stream=sys.stderr).sort_stats("cumtime").print_stats(25)
        else:
            res = run()
        times.append(time.perf_counter() - t0)
    best = res.best
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux
    out = dict(case=name, median_s=statistics.median(times), min_s=min(times), target_s=c["target_s"],
               peak_rss_gib=rss / GiB, configs=res.configs, partitioned=res.expanded, priced=res.priced)
    if best:
        p, e = best.plan, best.estimate
        out.update(plan=f"tp{p.mesh.tp} pp{p.mesh.pp} dp{p.mesh.dp} {p.pipeline.schedule} v{p.pipeline.virtual_stages} "
                        f"mb{p.training.micro_batch}x{p.pipeline.micro_batches} sp {sp_mode(p)}",
                   step_s=e.step_time_s, mfu=e.mfu)
    return out


def speed(args) -> int:
    rows = []
    for name in ([args.case] if args.case else CASES):
        cmd = [sys.executable, __file__, "--child", name, "--repeat", str(args.repeat), "--top", str(args.top),
               "--sp-saved-inputs", args.sp_saved_inputs] + ["--flat"] * args.flat
        if args.profile:
            cmd.append("--profile")
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            print(proc.stderr, file=sys.stderr)
            return proc.returncode
        if args.profile:
            print(proc.stderr, file=sys.stderr)
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    import pandas as pd
    df = pd.DataFrame(rows)
    df["ok"] = (df["median_s"] < df["target_s"]) & (df["peak_rss_gib"] < 2.0)
    with pd.option_context("display.width", 250, "display.max_columns", 30, "display.float_format", "{:.3f}".format):
        print(df.to_string(index=False))
    return 0 if df["ok"].all() else 1


def quality(args) -> int:
    from benchmarks.published import predict_row
    from benchmarks.run_settings import BEFORE_FLASH_ATTENTION
    from planner.cluster import load_cluster
    from planner.search import search

    rows, worse = [], 0
    for row in csv.DictReader(open(args.csv)):
        if row["source"] not in ("megatron-sc21-table1", "mt-nlg-530b"):
            continue
        model, pub = predict_row(row, framework=False)
        gpus = int(row["gpus"])
        cluster = load_cluster(row["cluster"], nodes=gpus // 8)
        t0 = time.perf_counter()
        res = search(model, cluster, global_batch=int(row["global_batch"]), seq_len=int(row["seq_len"]),
                     dtype=row["dtype"], dropout=0.1 if row["arch"] == "gpt" else 0.0,
                     attention="unfused" if row["source"] in BEFORE_FLASH_ATTENTION else "flash")
        el = time.perf_counter() - t0
        b = res.best
        pub_t = pub[1].tokens_per_s if pub else float("nan")
        got_t = b.estimate.tokens_per_s if b else float("nan")
        if pub and (not b or got_t < pub_t * (1 - 1e-9)):
            worse += 1
        rows.append(dict(model=row["model"], gpus=gpus,
                         published=f"tp{row['tp']} pp{row['pp']} dp{row['dp']}",
                         published_tokens_s=pub_t,
                         searched=(f"tp{b.plan.mesh.tp} pp{b.plan.mesh.pp} dp{b.plan.mesh.dp} {b.plan.pipeline.schedule} "
                                   f"v{b.plan.pipeline.virtual_stages} mb{b.plan.training.micro_batch}") if b else "none",
                         searched_tokens_s=got_t, gain=got_t / pub_t - 1, search_s=el))
        print(json.dumps(rows[-1]), file=sys.stderr)
    import pandas as pd
    with pd.option_context("display.width", 250, "display.max_columns", 30, "display.float_format", "{:,.3f}".format):
        print(pd.DataFrame(rows).to_string(index=False))
    print(f"\nrows where the search is slower than the published configuration: {worse}")
    return 0 if worse == 0 else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--top", type=int, default=1, help="alternatives kept (the CLI's --top; default 1)")
    ap.add_argument("--flat", action="store_true",
                    help="the search alone, asked for --top plans (the CLI's --dp-replicate 1); by default as "
                         "`trident search` runs: HSDP's pool of flat plans, each priced split into replicas")
    ap.add_argument("--case", choices=list(CASES))
    ap.add_argument("--profile", action="store_true", help="cProfile the search (to stderr)")
    ap.add_argument("--sp-saved-inputs", choices=("shard", "gathered", "either"), default="shard",
                    help="the search's --sp-saved-inputs (either: both modes searched)")
    ap.add_argument("--quality", action="store_true")
    ap.add_argument("--csv", default=str(ROOT.parent / "shared" / "reference" / "published_runs.csv"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(run_case(args.child, args.repeat, args.top, args.profile, args.sp_saved_inputs, args.flat)))
        return 0
    return quality(args) if args.quality else speed(args)


if __name__ == "__main__":
    sys.exit(main())
