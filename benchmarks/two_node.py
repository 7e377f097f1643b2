"""Two emulated nodes on one machine: measure the two link tiers, plan on them, and prove the
placement (needs root and iproute2; about 2-3 minutes).

    sudo python benchmarks/two_node.py [--rate 400] [--steps 6] [--keep DIR] [--json]
    sudo python benchmarks/two_node.py --tiers-only [--rates 100,400,1000] [--mbytes 16] [--reps 5]

Two network namespaces joined by a veth shaped to --rate Mbit/s (tests/cluster/netns.py), one
torchrun per namespace (2 nodes x 2 ranks, gloo on the veth). Inside a node the ranks talk through
loopback (the "NVLink" tier), across nodes through the shaped link (the "InfiniBand" tier).

1. `runtime.profile cluster --quick` across the two nodes: the intra-node tier is fitted on the
   groups inside a node ({0,1},{2,3}), the inter-node tier on the groups spanning nodes ({0,2},{1,3}
   and {0,1,2,3}), topology.node_of_rank from torchrun's node rank. Prints both tiers' all-reduce
   alpha and busbw against what the shaping implies: the link carries rate/8 bytes/s each way,
   shared by the 2 ranks of a node when both cross-node pairs run at once, so the per-device busbw
   the profile stores (planner.cluster: one NIC per device) should be rate/8/2.
2. planner.search.search for the tiny model on that profile, 2 nodes x 2 devices, global batch 8,
   fp32: the plan, whether its TP groups sit inside a node, and its mesh.order.
3. The same degrees with TP inside a node (TP innermost) and forced across the nodes (TP
   outermost), for the search's tp2 x pp2 and tp2 x dp2 plans and a default tp2 x pp2 one: both predicted with
   planner.cost.estimate on the measured profile and both trained for --steps steps across the two
   nodes (median step time after runtime.train's warm-up). A second prediction prices the layers
   from `runtime.profile model` (tiny, tp 1 and 2, run across the two nodes first; skip it with
   --no-model-profile): on a CPU the FLOP-based one misses the per-operator overhead. Exit 1 when the measured order
   contradicts the predicted one (both decisive: more than TIE = 10% apart) or a run fails; 2 when two nodes cannot be emulated here.

The link is shaped with tbf where the kernel has no netem (no delay then), with a burst of 4 KB
(tests/cluster/netns.py), so that the rate holds from small messages on; the rate is compared with
the largest-message segment of the inter-node fit (rate/8/2 per device).

--tiers-only: the older table, an all-reduce of --mbytes timed on the intra-node pairs and on the
cross-node pairs (tests/cluster/allreduce_tiers.py) for each of --rates.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from cluster.netns import available, torchrun_two_nodes, two_nodes  # noqa: E402

NODES, PER_NODE, GLOBAL_BATCH = 2, 2, 8


class Failed(Exception):
    pass


def _check(procs, what: str) -> None:
    for i, p in enumerate(procs):
        if p.returncode:
            raise Failed(f"{what}: node {i} failed (exit {p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")


# ------------------------------------------------------------------ --tiers-only (the older table)
def measure(rate_mbit: float, mbytes: float, reps: int) -> dict:
    with two_nodes(rate_mbit=rate_mbit) as h:
        procs = torchrun_two_nodes(h, [ROOT / "tests/cluster/allreduce_tiers.py", "--mbytes", mbytes,
                                       "--reps", reps], timeout=300)
        _check(procs, "allreduce_tiers")
        line = next(x for x in procs[0].stdout.splitlines() if x.startswith("TIERS_JSON "))
        return {"rate_mbit": rate_mbit, "shaping": h.shaping, **json.loads(line.split(" ", 1)[1])}


def tiers_table(args) -> int:
    rows = [measure(float(r), args.mbytes, args.reps) for r in args.rates.split(",")]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"all-reduce of {args.mbytes:g} MB, 2 nodes x 2 ranks (gloo), median of {args.reps}")
    print(f"{'link Mbit/s':>11} {'shaping':>7} {'intra ms':>9} {'intra GB/s':>10} {'cross ms':>9} "
          f"{'cross MB/s':>10} {'cross/intra':>11}")
    for r in rows:
        print(f"{r['rate_mbit']:>11g} {r['shaping']:>7} {1e3 * r['intra_s']:>9.1f} {r['intra_busbw_Bps'] / 1e9:>10.2f} "
              f"{1e3 * r['cross_s']:>9.1f} {r['cross_busbw_Bps'] / 1e6:>10.1f} {r['ratio']:>11.1f}")
    return 0


# ------------------------------------------------------------------ 1. the profile
def profile(h, out: Path, timeout: float) -> dict:
    t0 = time.monotonic()
    procs = torchrun_two_nodes(h, ["-m", "runtime.profile", "cluster", "-o", out, "--quick", "--name",
                                   "two-emulated-nodes"], timeout=timeout, port=29511)
    _check(procs, "runtime.profile cluster")
    if not out.exists():
        raise Failed(f"runtime.profile cluster wrote no {out}")
    d = json.loads(out.read_text())
    print(f"[1] profile {out} ({time.monotonic() - t0:.0f} s): nodes {d['nodes']} x {d['devices_per_node']}, "
          f"topology.node_of_rank {d['topology']['node_of_rank']}")
    return d


def _large(fit: dict) -> tuple[float, float]:
    """(alpha, busbw) of the fit's largest-message segment (the whole fit where it has none)."""
    seg = (fit.get("segments") or [fit])[-1]
    return seg["alpha_s"], seg["bus_bandwidth_bytes_per_s"]


def _largest_ratio(d: dict) -> float:
    """Time of the largest swept all-reduce on the cross-node pairs over the intra-node pairs."""
    sw = d["sweep"]["all_reduce"]
    return sw["2x"][-1][1] / sw["2"][-1][1]


def tier_report(d: dict, rate_mbit: float, shaping: str = "tbf") -> dict:
    ar = d["collectives"]["all_reduce"]
    link = rate_mbit * 1e6 / 8
    implied = link / PER_NODE  # per device: the node's ranks share its one link
    rows = [("intra_node", "2", "n=2 {0,1},{2,3}"), ("inter_node", "2", "n=2 {0,2},{1,3}"),
            ("inter_node", "4", "n=4 {0,1,2,3}")]
    out = {}
    print("    all_reduce fits (t = alpha + 2(n-1)/n S / busbw; inter-node busbw per device = measured / members "
          "per node): whole sweep | largest-message segment")
    for tier, n, what in rows:
        fit = ar[tier]["by_group_size"].get(n)
        if fit is None:
            continue
        la, lb = _large(fit)
        out[f"{tier}_{n}"] = {"alpha_s": fit["alpha_s"], "busbw": fit["bus_bandwidth_bytes_per_s"],
                              "large_alpha_s": la, "large_busbw": lb}
        seg = (f"alpha {la * 1e6:6.0f} us busbw {lb / 1e6:8.1f} MB/s" if lb < 1e12 else
               f"alpha {la * 1e6:6.0f} us, flat (time does not grow with the size over the segment)")
        print(f"    {tier:<10} {what:<16} alpha {fit['alpha_s'] * 1e6:7.0f} us busbw "
              f"{fit['bus_bandwidth_bytes_per_s'] / 1e6:8.1f} MB/s | {seg}")
    x2 = out["inter_node_2"]["large_busbw"]
    ratio = x2 / implied
    out.update(implied_per_device_busbw=implied, inter_over_implied=ratio, within_20pct=abs(ratio - 1) <= 0.2)
    print(f"    shaping: {rate_mbit:g} Mbit/s = {link / 1e6:.0f} MB/s each way, shared by the {PER_NODE} ranks of a "
          f"node -> {implied / 1e6:.1f} MB/s per device; the measured inter-node busbw (n=2, largest-message "
          f"segment) is {x2 / 1e6:.1f} MB/s = {ratio:.2f} x that ({'within' if out['within_20pct'] else 'NOT within'}"
          f" 20%); the whole-sweep fit is {out['inter_node_2']['busbw'] / 1e6:.1f} MB/s")
    print(f"    intra / inter busbw (n=2, whole-sweep fits): {out['intra_node_2']['busbw'] / out['inter_node_2']['busbw']:.0f} x"
          f"; intra / inter time of the largest all-reduce: {_largest_ratio(d):.0f} x")
    return out


def model_profile(h, cluster_path: Path, out: Path, timeout: float):
    """runtime.profile model for the tiny model across the two nodes (tp 1 and 2, groups inside a
    node), so that the cost model can also price layers from measured times."""
    t0 = time.monotonic()
    procs = torchrun_two_nodes(h, ["-m", "runtime.profile", "model", "--model", "tiny", "--cluster-profile",
                                   cluster_path, "--seq-len", "64", "--micro-batches", "1,2,4", "--tp", "1,2",
                                   "--repeats", "3", "-o", out], timeout=timeout, port=29541)
    _check(procs, "runtime.profile model")
    from planner.model_profile import load_model_profile
    print(f"    model profile {out} ({time.monotonic() - t0:.0f} s)")
    return load_model_profile(str(out))


# ------------------------------------------------------------------ 2. the search
def tp_spans_nodes(plan, cluster) -> list[bool]:
    return [len({cluster.node_of(r) for r in g}) > 1 for g in plan.mesh.groups("tp")]


def search_plan(profile_path: Path):
    from planner.cluster import load_cluster
    from planner.search import search
    from planner.zoo import ZOO
    cluster = load_cluster(str(profile_path))
    t0 = time.monotonic()
    res = search(ZOO["tiny"], cluster, global_batch=GLOBAL_BATCH, dtype="fp32", top=20)
    if res.best is None:
        raise Failed(f"search found no plan (min required {res.min_required_bytes})")
    best = res.best.plan
    m = best.mesh
    print(f"[2] search ({time.monotonic() - t0:.1f} s, {res.configs} configs): best tp{m.tp} x pp{m.pp} x dp{m.dp}, "
          f"{best.pipeline.schedule}, micro-batch {best.training.micro_batch}, mesh.order {m.order}, "
          f"predicted {res.best.estimate.step_time_s * 1e3:.1f} ms/step")
    if m.tp > 1:
        spans = tp_spans_nodes(best, cluster)
        print(f"    TP groups {m.groups('tp')}: {'inside a node' if not any(spans) else 'SPANNING nodes'} "
              f"(node_of_rank {cluster.node_of_rank})")
    else:
        print("    no tensor parallelism in the best plan")
    tp2 = next((f for f in res.results if f.plan.mesh.tp == 2), None)
    return cluster, res, tp2


# ------------------------------------------------------------------ 3. placement proof
TIE = 0.10  # measured or predicted within 10%: a tie, which contradicts nothing (2-CPU noise)


def variants(base, cluster):
    """(inside, across): `base` with TP inside a node (TP innermost) and with TP outermost."""
    from planner.plan import Plan
    d = base.to_dict()
    m = base.mesh
    if any(tp_spans_nodes(base, cluster)):
        d["mesh"]["order"] = ["pp", "dp", "tp"]
    inside = Plan.from_dict(json.loads(json.dumps(d)))
    d["mesh"]["order"] = ["tp", "pp", "dp"] if m.pp > 1 and m.dp == 1 else ["tp", "dp", "pp"]
    across = Plan.from_dict(json.loads(json.dumps(d)))
    if any(tp_spans_nodes(inside, cluster)) or not all(tp_spans_nodes(across, cluster)):
        raise Failed(f"placement: inside {inside.mesh.groups('tp')} / across {across.mesh.groups('tp')} "
                     f"do not put TP inside / across nodes (node_of_rank {cluster.node_of_rank})")
    return inside, across


def tp2_plans(res, cluster) -> list:
    """The plans whose placement is compared: the search's best tp2 x pp2 and tp2 x dp2 plans (built
    with defaults where the search kept none), the one with the search's pp and dp first, then a
    default tp2 x pp2 GPipe plan with one micro-batch of the whole batch (TP messages of 8 x 64
    tokens x 128 x 4 B = 256 KB: the most TP traffic per message)."""
    from planner.zoo import ZOO
    from planner.build import build_plan

    def default(pp, mb=1, schedule="1f1b"):
        return build_plan(ZOO["tiny"], cluster_name=cluster.name, device="cpu", nodes=NODES, devices_per_node=PER_NODE,
                          global_batch=GLOBAL_BATCH, micro_batch=mb, seq_len=ZOO["tiny"].seq_len, tp=2, pp=pp,
                          dtype="fp32", schedule=schedule)
    out = []
    for pp, dp in ((2, 1), (1, 2)):
        f = next((f for f in res.results if (f.plan.mesh.tp, f.plan.mesh.pp, f.plan.mesh.dp) == (2, pp, dp)), None)
        out.append(f.plan if f else default(pp))
    best = res.best.plan.mesh
    out.sort(key=lambda p: (p.mesh.pp, p.mesh.dp) != (best.pp, best.dp))
    extra = default(2, GLOBAL_BATCH, "gpipe")
    if all(extra.content_hash() != p.content_hash() for p in out):
        out.append(extra)
    return out


def train(h, plan, name: str, work: Path, steps: int, timeout: float, port: int) -> dict:
    plan_path, out = work / f"{name}.plan.json", work / f"{name}.run.json"
    plan.write(plan_path)
    t0 = time.monotonic()
    procs = torchrun_two_nodes(h, ["-m", "runtime.train", "--plan", plan_path, "--steps", steps, "--out", out],
                               timeout=timeout, port=port)
    _check(procs, f"runtime.train ({name})")
    if not out.exists():
        raise Failed(f"runtime.train ({name}) wrote no {out}")
    run = json.loads(out.read_text())
    times = run["step_times_s"][run["warmup_steps"]:] or run["step_times_s"]
    run["median_step_s"] = statistics.median(times)
    run["wall_s"] = time.monotonic() - t0
    return run


def _order(a: float, b: float) -> int:
    """-1: a faster, 1: b faster, 0: within TIE of each other."""
    return 0 if abs(b / a - 1) <= TIE else (-1 if a < b else 1)


def placement(h, base, cluster, mprof, work: Path, steps: int, timeout: float, port: int) -> dict:
    from planner.cost import estimate
    inside, across = variants(base, cluster)
    m = inside.mesh
    t = inside.training
    tag = f"tp{m.tp}pp{m.pp}dp{m.dp}-{inside.pipeline.schedule}-mb{t.micro_batch}"
    msg = 4 * t.micro_batch * t.seq_len * inside.model.hidden
    print(f"    {tag}: {inside.pipeline.schedule}, micro-batch {t.micro_batch}, seq {t.seq_len}, TP messages "
          f"{msg / 1e3:.0f} KB, {steps} steps per placement")
    rows = {}
    for i, (name, plan) in enumerate((("inside", inside), ("across", across))):
        est = estimate(plan, cluster)
        est_m = estimate(plan, cluster, model_profile=mprof) if mprof is not None else None
        run = train(h, plan, f"{tag}-{name}", work, steps, timeout, port + i)
        rows[name] = {"order": plan.mesh.order, "tp_groups": plan.mesh.groups("tp"),
                      "tp_nodes": [[cluster.node_of(r) for r in g] for g in plan.mesh.groups("tp")],
                      "predicted_s": est.step_time_s,
                      "predicted_profiled_s": est_m.step_time_s if est_m else None,
                      "measured_s": run["median_step_s"], "step_times_s": run["step_times_s"],
                      "warmup_steps": run["warmup_steps"], "final_loss": run["losses"][-1]}
        print(f"      TP {name:<6} order {str(plan.mesh.order):<22} tp groups {str(plan.mesh.groups('tp'))} on nodes "
              f"{rows[name]['tp_nodes']}: predicted {est.step_time_s * 1e3:6.1f} ms"
              + (f" (with the model profile {est_m.step_time_s * 1e3:6.1f} ms)" if est_m else "")
              + f", measured {run['median_step_s'] * 1e3:6.1f} ms (median of {len(run['step_times_s']) - run['warmup_steps']}"
              f" after {run['warmup_steps']} warm-up; {run['wall_s']:.0f} s)")
    ri, ra = rows["inside"], rows["across"]
    pred, meas = _order(ri["predicted_s"], ra["predicted_s"]), _order(ri["measured_s"], ra["measured_s"])
    contradicts = pred * meas < 0
    words = {-1: "TP inside faster", 1: "TP across faster", 0: f"a tie (within {TIE:.0%})"}
    line = (f"      across / inside: predicted {ra['predicted_s'] / ri['predicted_s']:.2f} x ({words[pred]})"
            + (f", with the model profile {ra['predicted_profiled_s'] / ri['predicted_profiled_s']:.2f} x"
               if mprof is not None else "")
            + f", measured {ra['measured_s'] / ri['measured_s']:.2f} x ({words[meas]}) -> "
            + ("CONTRADICTS the prediction" if contradicts else "consistent with the prediction"))
    print(line)
    if ri["final_loss"] != ra["final_loss"]:
        print(f"      (final losses differ: {ri['final_loss']} vs {ra['final_loss']})")
    return {"plan": tag, "rows": rows, "predicted_order": pred, "measured_order": meas, "contradicts": contradicts}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=400, help="link rate in Mbit/s")
    ap.add_argument("--steps", type=int, default=6, help="training steps per placement (the first is warm-up)")
    ap.add_argument("--keep", default=None, help="directory for the profile, plans and run.json files")
    ap.add_argument("--comparisons", type=int, default=3, choices=(1, 2, 3),
                    help="placements compared: the search's tp2 x pp2 and tp2 x dp2 plans (the search's degrees "
                         "first) and a tp2 x pp2 GPipe plan of one 8-sequence micro-batch; the first N of them")
    ap.add_argument("--no-model-profile", action="store_true",
                    help="skip runtime.profile model (the second prediction, from measured layer times)")
    ap.add_argument("--json", action="store_true", help="also print one JSON line of the figures (BENCH_JSON ...)")
    ap.add_argument("--tiers-only", action="store_true", help="only the all-reduce table for --rates")
    ap.add_argument("--rates", default="100,400,1000", help="--tiers-only: link rates in Mbit/s, comma-separated")
    ap.add_argument("--mbytes", type=float, default=16, help="--tiers-only: all-reduce size")
    ap.add_argument("--reps", type=int, default=5, help="--tiers-only: repeats")
    args = ap.parse_args(argv)
    ok, why = available()
    if not ok:
        print(f"two_node: cannot emulate two nodes here: {why}", file=sys.stderr)
        return 2
    if args.tiers_only:
        try:
            return tiers_table(args)
        except Failed as exc:
            print(f"two_node: {exc}", file=sys.stderr)
            return 1
    t0 = time.monotonic()
    tmp = None
    if args.keep:
        work = Path(args.keep).resolve()
        work.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="trident-two-node-")
        work = Path(tmp.name)
    try:
        with two_nodes(rate_mbit=args.rate, delay_ms=1.0) as h:
            print(f"two emulated nodes: {h.names}, link {args.rate:g} Mbit/s ({h.shaping}"
                  f"{', +1 ms delay' if h.delay_applied else ', no delay: the kernel has no netem'}), 2 ranks each")
            cluster_path = work / "two-node.cluster.json"
            d = profile(h, cluster_path, timeout=240)
            tiers = tier_report(d, args.rate, h.shaping)
            cluster, res, _ = search_plan(cluster_path)
            print("[3] placement: the same degrees with TP inside a node vs across the nodes")
            mprof = None
            if not args.no_model_profile:
                mprof = model_profile(h, cluster_path, work / "tiny.model.json", timeout=150)
            proofs = [placement(h, plan, cluster, mprof, work, args.steps, timeout=180, port=29551 + 10 * i)
                      for i, plan in enumerate(tp2_plans(res, cluster)[:args.comparisons])]
        best = res.best.plan
        if args.json:
            print("BENCH_JSON " + json.dumps({
                "tiers": tiers, "node_of_rank": d["topology"]["node_of_rank"], "shaping": h.shaping,
                "search": {"tp": best.mesh.tp, "pp": best.mesh.pp, "dp": best.mesh.dp, "order": best.mesh.order,
                           "tp_inside_node": not any(tp_spans_nodes(best, cluster)),
                           "predicted_s": res.best.estimate.step_time_s},
                "placement": proofs}))
        bad = [p["plan"] for p in proofs if p["contradicts"]]
        print(f"done in {time.monotonic() - t0:.0f} s" + (f"; files in {work}" if args.keep else "")
              + (f"; the measured order CONTRADICTS the predicted one for {', '.join(bad)}" if bad else ""))
        return 1 if bad else 0
    except Failed as exc:
        print(f"two_node: {exc}", file=sys.stderr)
        return 1
    finally:
        if tmp is not None:
            tmp.cleanup()


if __name__ == "__main__":
    sys.exit(main())
