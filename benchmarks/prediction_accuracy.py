"""Prediction accuracy on this machine: profile it, predict plans, run them, compare.

    python benchmarks/prediction_accuracy.py [--out out/accuracy] [--steps 12] [--rounds 3]
                                             [--reuse-profiles] [--only NAME ...] [--no-search]

1. Per world size (1, 2, 4) and model (tiny at seq 32; the larger "small", ~28M parameters, at
   seq 64), right before its plans train: `runtime.profile cluster` (once per world size; on 2
   gloo processes for world 1) and `runtime.profile model`. On this machine a "device" is a
   process and processes share two CPU cores, so a device's speed depends on how many run at
   once; each plan is priced with the profiles measured at its own world size (the 1-process
   plans with the 2-process cluster profile, whose collectives they never use).
2. Plans on 1, 2 and 4 processes (data parallel, ZeRO-1/3, TP, TP+SP, GPipe / 1F1B / interleaved /
   ZB-V pipelines (one with ZeRO-3, one recomputing every block), recomputation, mixes), each predicted by planner.cost.estimate with the measured
   cluster and model profiles, then trained with runtime.train under torchrun (one launch per
   model and world size, several plans per launch). On 2 and 4 processes the search's own pick
   on the measured profiles (planner.search.search_profiled) joins the plans of its launch, and
   is compared with the fastest of the others as measured.
3. Steps 1-2 are one round; the benchmark runs --rounds independent rounds (each its own profiles,
   predictions and launches; the search's pick is made in the first round and kept). The timings
   of processes sharing two cores move by tens of percent between launches minutes apart (the
   spread is printed). Each round is one trial of the whole loop; a plan's error is the median of
   its errors over the rounds. Printed too: the median prediction against the median measurement
   per plan (Kendall's tau is computed between these medians), and every single round's errors.
4. A table of predicted vs measured step time (median after warm-up), optimizer step and peak
   memory, the median and worst absolute step-time error, Kendall's tau between predicted and
   measured step times, and the worst memory under-prediction; results.json under --out.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from planner.cluster import load_cluster  # noqa: E402
from planner.compare import SLOTS_DRIFT, compare  # noqa: E402
from planner.cost import estimate  # noqa: E402
from planner.model_profile import load_model_profile  # noqa: E402
from planner.build import build_plan  # noqa: E402
from planner.search import search_profiled  # noqa: E402
from planner.zoo import ZOO  # noqa: E402
from runtime.host_share import busy_cores  # noqa: E402

# model: (sequence length, global batch, micro-batch sizes profiled, profile repeats)
MODELS = {"tiny": (32, 8, "1,2,4", 9), "small": (64, 8, "1,2,4", 5)}

# name: (model, world, build_plan keywords)
PLANS = {
    "w1-single-mb2": ("tiny", 1, dict(micro_batch=2)),
    "w1-full-recompute": ("tiny", 1, dict(micro_batch=4, recompute="full")),
    "w2-dp2": ("tiny", 2, dict(micro_batch=2, zero=0)),
    "w2-zero3": ("tiny", 2, dict(micro_batch=4, zero=3)),
    "w2-zero1-selective": ("tiny", 2, dict(micro_batch=2, zero=1, recompute="selective")),
    "w2-tp2": ("tiny", 2, dict(micro_batch=4, tp=2)),
    "w2-tp2-sp": ("tiny", 2, dict(micro_batch=4, tp=2, sequence_parallel=True)),
    "w2-pp2-gpipe": ("tiny", 2, dict(micro_batch=2, pp=2, schedule="gpipe")),
    "w2-pp2-1f1b": ("tiny", 2, dict(micro_batch=1, pp=2, schedule="1f1b")),
    "w2-pp2-interleaved": ("tiny", 2, dict(micro_batch=2, pp=2, schedule="interleaved-1f1b", virtual_stages=2)),
    "w2-pp2-zbv": ("tiny", 2, dict(micro_batch=1, pp=2, schedule="zbv")),
    "w2-pp2-zbv-full": ("tiny", 2, dict(micro_batch=1, pp=2, schedule="zbv", recompute="full")),
    "w4-dp4": ("tiny", 4, dict(micro_batch=2, zero=0)),
    "w4-zero3-full": ("tiny", 4, dict(micro_batch=2, zero=3, recompute="full")),
    "w4-tp2-dp2": ("tiny", 4, dict(micro_batch=4, tp=2, zero=1)),
    "w4-tp4-sp": ("tiny", 4, dict(micro_batch=4, tp=4, sequence_parallel=True)),
    "w4-pp2-tp2-1f1b": ("tiny", 4, dict(micro_batch=2, pp=2, tp=2, schedule="1f1b")),
    "w4-pp4-1f1b": ("tiny", 4, dict(micro_batch=1, pp=4, schedule="1f1b")),
    "w4-pp2-dp2-gpipe": ("tiny", 4, dict(micro_batch=2, pp=2, schedule="gpipe", zero=0)),
    "w4-pp2-dp2-zbv-zero3": ("tiny", 4, dict(micro_batch=1, pp=2, schedule="zbv", zero=3)),
    "w4-hsdp-zero3": ("tiny", 4, dict(micro_batch=2, zero=3, dp_replicate=2)),  # 2 replicas x 2 shards
    # context parallelism: each sequence over 2 ranks (the twins of w2-dp2, w4-dp4 and w4-tp2-dp2)
    "w2-cp2": ("tiny", 2, dict(micro_batch=4, zero=0, cp=2)),
    "w4-cp2-dp2": ("tiny", 4, dict(micro_batch=4, zero=0, cp=2)),
    "w4-cp2-tp2-zero1": ("tiny", 4, dict(micro_batch=4, tp=2, zero=1, cp=2)),
    "small-w4-cp2-dp2-zero3": ("small", 4, dict(micro_batch=2, zero=3, cp=2)),
    # a larger CPU-sized model (zoo "small": 8 layers, hidden 512, ~28M parameters)
    "small-w2-zero1": ("small", 2, dict(micro_batch=2, zero=1)),
    "small-w2-tp2": ("small", 2, dict(micro_batch=2, tp=2)),
    "small-w4-dp4-zero3": ("small", 4, dict(micro_batch=1, zero=3)),
    "small-w4-hsdp-zero3": ("small", 4, dict(micro_batch=1, zero=3, dp_replicate=2)),
    "small-w4-pp4-1f1b": ("small", 4, dict(micro_batch=1, pp=4, schedule="1f1b")),
    "small-w4-pp2-tp2-1f1b": ("small", 4, dict(micro_batch=1, pp=2, tp=2, schedule="1f1b")),
}


def env() -> dict:
    e = dict(os.environ, OMP_NUM_THREADS="1")
    e["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), e.get("PYTHONPATH")]))
    return e


def torchrun(nproc: int, module: str, *args) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(port),
           "-m", module, *map(str, args)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    for line in proc.stderr.splitlines():  # the machine was busy with other work (runtime.host_share)
        at = line.find("trident profile: warning:")  # maybe after a progress bar's text
        if at >= 0 or line.startswith("warning:"):
            print(f"  {line[max(at, 0):].strip()}", flush=True)
    print(f"  {module} {args[0] if args else ''} on {nproc}: {time.perf_counter() - t0:.0f} s", flush=True)


def profiles(out: Path, world: int, model: str, reuse: bool) -> tuple[Path, Path]:
    """(cluster profile, model profile) of `world` processes, measured unless reused (the cluster
    profile once per world size)."""
    c = out / f"cpu-gloo-{max(world, 2)}.json"
    if not (reuse and c.exists()) and c not in _MEASURED:
        torchrun(max(world, 2), "runtime.profile", "cluster", "-o", c)
        _MEASURED.add(c)
    m = out / f"{model}-w{world}.json"
    seq, _, mbs, repeats = MODELS[model]
    if not (reuse and m.exists()):
        tps = ",".join(str(t) for t in (1, 2, 4) if t <= world and (t < 4 or model == "tiny"))
        cps = sorted({kw.get("cp", 1) for mdl, w, kw in PLANS.values() if (mdl, w) == (model, world)})
        torchrun(world, "runtime.profile", "model", "--model", model, "--cluster-profile", c, "--seq-len", seq,
                 "--micro-batches", mbs, "--tp", tps, "--cp", ",".join(map(str, cps)), "--repeats", repeats, "-o", m)
    return c, m


_MEASURED: set = set()


def kendall_tau(xs, ys) -> float:
    """Kendall's tau-a: (concordant - discordant) / pairs."""
    n, s = len(xs), 0
    for i in range(n):
        for j in range(i + 1, n):
            a, b = xs[i] - xs[j], ys[i] - ys[j]
            s += (a * b > 0) - (a * b < 0)
    return s / (n * (n - 1) / 2)


def run_round(out: Path, names: list, args, searched: dict, group_of: dict) -> dict:
    """One round: per (model, world) group profile, predict its plans, and train them in one launch.
    The search's pick per group is made in the first round (`searched` empty) and kept for later
    rounds. Returns {plan name: compare() row}."""
    (out / "plans").mkdir(parents=True, exist_ok=True)
    _MEASURED.clear()
    plans = {}
    for model, world in sorted(set(group_of.values()), key=lambda g: (g[1], g[0] != "tiny")):
        # profile right before training: the same machine state
        cpath, mpath = profiles(out, world, model, args.reuse_profiles)
        cluster, mp = load_cluster(str(cpath)), load_model_profile(str(mpath))
        seq, gb = MODELS[model][:2]
        mine = [n for n in names if group_of[n] == (model, world)]
        for name in mine:
            plan = build_plan(ZOO[model], cluster_name=cluster.name, device=cluster.device.name, nodes=1,
                              devices_per_node=world, global_batch=gb, seq_len=seq, dtype="fp32",
                              profile_hash=cluster.profile_hash, **PLANS[name][2])
            plans[name] = plan
        if world > 1 and not args.no_search:  # the search's pick on the measured profiles joins the sweep
            name = ("" if model == "tiny" else f"{model}-") + f"w{world}-searched"
            if (model, world) not in searched:
                found = search_profiled(ZOO[model], cluster.shaped_as(1, world), mp, global_batch=gb, seq_len=seq,
                                        dtype="fp32").best
                searched[(model, world)] = (name, found.plan)
            plans[name] = searched[(model, world)][1]
            group_of[name] = (model, world)
            mine.append(name)
        for name in mine:
            est = estimate(plans[name], cluster, model_profile=mp)
            plans[name].prediction = est.to_dict()
            plans[name].write(out / "plans" / f"{name}.json")
        runs = out / f"runs-{model}-w{world}"
        runs.mkdir(exist_ok=True)
        torchrun(world, "runtime.train", "--plan", *[out / "plans" / f"{n}.json" for n in mine], "--steps", args.steps,
                 "--out", runs if len(mine) > 1 else runs / f"{mine[0]}.json")
    rows = {}
    for name, plan in plans.items():
        model, world = group_of[name]
        run = json.loads((out / f"runs-{model}-w{world}" / f"{name}.json").read_text())
        rows[name] = dict(compare(plan, run, plan.prediction), plan=plan,
                          breakdown={k: v for k, v in plan.prediction["breakdown"]["time"].items() if k.endswith("_s")})
    return rows


KEYS = ("predicted_step_time_s", "measured_step_time_s", "predicted_peak_memory_bytes", "measured_peak_memory_bytes",
        "predicted_optimizer_s", "measured_optimizer_s")


def median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "out" / "accuracy"))
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=3, help="independent rounds of profile + predict + train; "
                    "per plan the medians over rounds are compared")
    ap.add_argument("--reuse-profiles", action="store_true")
    ap.add_argument("--only", nargs="*", default=None, help="plan names (default: all)")
    ap.add_argument("--no-search", action="store_true", help="leave out the search's pick on the measured profiles")
    args = ap.parse_args(argv)
    out = Path(args.out)
    names = args.only or list(PLANS)
    unknown = [n for n in names if n not in PLANS]
    if unknown or args.rounds < 1:
        sys.exit(f"--only: unknown plan {unknown[0]}; use {', '.join(PLANS)}" if unknown else "--rounds: at least 1")
    busy = busy_cores(2.0)
    print(f"{len(os.sched_getaffinity(0))} CPUs, {'?' if busy is None else f'{busy:.1f}'} of them busy over 2 s "
          f"before the start; {args.rounds} rounds of: per world size profile, predict, train", flush=True)
    group_of = {n: PLANS[n][:2] for n in names}  # (model, world)
    searched, rounds = {}, []
    for i in range(args.rounds):
        print(f"round {i + 1} of {args.rounds}", flush=True)
        rounds.append(run_round(out / f"round{i + 1}", names, args, searched, group_of))
    rows = []
    for name in group_of:
        per = [r[name] for r in rounds]
        row = {"plan": name, **{k: median([p[k] for p in per]) for k in KEYS}}
        # each round is one trial of the whole loop: the plan's error is the median of its errors
        row["step_time_error"] = median([p["step_time_error"] for p in per])
        row["memory_error"] = median([p["memory_error"] for p in per])
        row["error_of_medians"] = row["predicted_step_time_s"] / row["measured_step_time_s"] - 1
        row["rounds"] = {k: [p[k] for p in per] for k in ("predicted_step_time_s", "measured_step_time_s")}
        row["breakdown"] = {k: median([p["breakdown"].get(k, 0.0) for p in per]) for k in per[0]["breakdown"]}
        rows.append(row)
    print_table(rows)
    errs = sorted(abs(r["step_time_error"]) for r in rows)
    med = median(errs)
    tau = kendall_tau([r["predicted_step_time_s"] for r in rows], [r["measured_step_time_s"] for r in rows])
    under = max(0.0, -min(r["memory_error"] for r in rows))
    single = sorted(abs(p["step_time_error"]) for r in rounds for p in r.values())
    of_medians = sorted(abs(r["error_of_medians"]) for r in rows)
    summary = {"plans": len(rows), "rounds": args.rounds, "median_abs_step_time_error": med,
               "worst_abs_step_time_error": errs[-1], "kendall_tau": tau, "worst_memory_under_prediction": under,
               "error_of_medians": {"median": median(of_medians), "worst": of_medians[-1]},
               "single_round_median_abs_step_time_error": median(single),
               "single_round_worst_abs_step_time_error": single[-1],
               "measured_spread": spread(rows),
               # plans whose run found other work on the cores (runtime.train's host_other_busy_cores)
               "runs_beside_other_work": sorted({n for r in rounds for n, p in r.items() if p.get("host_note")}),
               # plans whose processes computed together at another share of the cores than their
               # cluster profile priced (planner.compare.slots_note): (measured, priced) per round
               "runs_on_a_changed_machine": changed_machine(rounds),
               "targets": {"median": 0.10, "worst": 0.25, "tau": 0.8, "memory_under": 0.05}}
    summary["searched"] = searched_vs_sweep(rows, {n: rounds[0][n]["plan"] for n in group_of},
                                            {g: v[0] for g, v in searched.items()}, group_of)
    print(f"\nper plan the median of its errors over {args.rounds} rounds: median |step-time error| {med:.1%} "
          f"(target <= 10%), "
          f"worst {errs[-1]:.1%} (<= 25%), Kendall tau {tau:.2f} (>= 0.8), worst memory under-prediction "
          f"{under:.1%} (<= 5%)")
    print(f"per plan the median prediction against the median measurement: median |error| {median(of_medians):.1%}"
          f", worst {of_medians[-1]:.1%}; Kendall tau above is between these medians")
    print(f"single rounds (each plan in each round on its own): median |error| {median(single):.1%}, worst "
          f"{single[-1]:.1%}; measured step time across rounds, max / min per plan: median "
          f"{summary['measured_spread']['median']:.2f}, worst {summary['measured_spread']['worst']:.2f} "
          f"({summary['measured_spread']['worst_plan']})")
    if summary["runs_on_a_changed_machine"]:
        print(f"runs whose processes computed together at more than {SLOTS_DRIFT:.0%} off the compute_slots their "
              "profile priced "
              "(the machine changed speed in between; measured / priced): "
              + ", ".join(f"{n} " + " ".join(f"{a:.2f}/{b:.2f}" for a, b in v)
                          for n, v in summary["runs_on_a_changed_machine"].items()))
    if summary["runs_beside_other_work"]:
        print(f"runs beside other work on the cores (their times are a busy machine's): "
              f"{', '.join(summary['runs_beside_other_work'])}")
    (out / "results.json").write_text(json.dumps({"summary": summary, "rows": rows}, indent=2) + "\n")
    return 0


def changed_machine(rounds) -> dict:
    """{plan: [(measured, priced compute_slots) of each round whose run noted the change]}."""
    out = {}
    for r in rounds:
        for name, p in r.items():
            if p.get("machine_note"):
                out.setdefault(name, []).append((p["measured_compute_slots"], p["predicted_compute_slots"]))
    return out


def spread(rows) -> dict:
    """How much a plan's measured step time moved between rounds (max / min), the noise floor."""
    s = {r["plan"]: max(r["rounds"]["measured_step_time_s"]) / min(r["rounds"]["measured_step_time_s"]) for r in rows}
    worst = max(s, key=s.get)
    return {"median": median(list(s.values())), "worst": s[worst], "worst_plan": worst}


def searched_vs_sweep(rows, plans, searched, group_of) -> dict:
    """Per model and world size: the search's pick (planner.search.search_profiled on the measured
    profiles) against every other plan of that group in the sweep, all measured in one launch."""
    meas = {r["plan"]: r["measured_step_time_s"] for r in rows}
    out = {}
    for group, name in searched.items():
        others = {n: meas[n] for n in meas if group_of[n] == group and n != name}
        if not others:
            continue
        same = [n for n in others if plans[n].content_hash() == plans[name].content_hash()]
        fastest = min(others, key=others.get)
        m = plans[name].mesh
        ratio = meas[name] / others[fastest]
        key = f"{group[0]}-w{group[1]}"
        out[key] = {"plan": name, "degrees": f"tp{m.tp} pp{m.pp} dp{m.dp} {plans[name].pipeline.schedule} "
                    f"mb{plans[name].training.micro_batch}", "measured_s": meas[name], "fastest_other": fastest,
                    "fastest_other_s": others[fastest], "ratio": ratio, "same_as": same}
        print(f"\nsearch on the measured profiles, {group[0]} on {group[1]} processes: {out[key]['degrees']}"
              + (f" (the same plan as {', '.join(same)})" if same else "")
              + f", measured {meas[name] * 1e3:.1f} ms; fastest other plan of the sweep {fastest} "
              f"{others[fastest] * 1e3:.1f} ms: searched / fastest = {ratio:.2f}"
              + (" (the searched plan is the fastest measured)" if ratio <= 1 else ""))
    return out


def print_table(rows) -> None:
    mib = 2**20
    keys = ("compute_s", "tp_comm_s", "dp_comm_exposed_s", "pipeline_bubble_s", "p2p_s", "optimizer_s",
            "runtime_sync_s", "pipeline_overhead_s")
    head = (f"{'plan':<24}{'pred ms':>9}{'meas ms':>9}{'err':>8}{'opt pred':>9}{'meas':>7}{'pred MiB':>10}"
            f"{'meas MiB':>10}{'err':>8}   predicted breakdown ms: " + " ".join(k[:-2] for k in keys))
    print("pred / meas: medians over the rounds; err: the median of the plan's errors in each round")
    print(head)
    for r in rows:
        b = r["breakdown"]
        print(f"{r['plan']:<24}{r['predicted_step_time_s'] * 1e3:9.1f}{r['measured_step_time_s'] * 1e3:9.1f}"
              f"{r['step_time_error']:+8.1%}{r['predicted_optimizer_s'] * 1e3:9.1f}{r['measured_optimizer_s'] * 1e3:7.1f}"
              f"{r['predicted_peak_memory_bytes'] / mib:10.2f}"
              f"{r['measured_peak_memory_bytes'] / mib:10.2f}{r['memory_error']:+8.1%}   "
              + " ".join(f"{b.get(k, 0.0) * 1e3:.1f}" for k in keys))


if __name__ == "__main__":
    sys.exit(main())
