"""Peak memory of data-parallel ZeRO plans trained on this machine against the planner's
prediction, rank by rank (about 3 minutes on 2 cores).

    python benchmarks/zero_memory.py [--only NAME ...] [--keep DIR] [--reuse] [--json]

Each plan (ZeRO 1, 2 and 3; tied and untied embeddings; one and several micro-batches; every
recompute mode it names; float32 and bf16) trains 3 steps in gloo processes (runtime.train, one
torchrun per world size and dtype, several plans each) and its record's per-rank peak
(run.json peak_memory_bytes_per_rank: the C heap's high mark in the measured step, over the
tensors alive at its start) is divided by planner.cost.estimate's peak for the rank, priced for
gloo (whose collectives take temporaries; planner.fsdp_memory). Memory does not depend on the
device's speed, so the prediction takes any shipped cluster reshaped to the plan's world size.
A ratio above 1 is an under-prediction, which the planner must not make (the CPU heap moves by up
to 3% between runs of one plan: tests/test_runtime.py). Exit 1 where a rank measures more than
1.03 of its prediction or a run fails. --reuse prices the records a --keep DIR holds again
without training (to compare versions of the memory model on the same runs).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.prediction_accuracy import torchrun  # noqa: E402
from planner.build import build_plan  # noqa: E402
from planner.cluster import load_cluster  # noqa: E402
from planner.cost import estimate  # noqa: E402
from planner.plan import Plan  # noqa: E402
from planner.zoo import ZOO  # noqa: E402

MiB = 2**20
UNDER = 1.03  # the CPU heap's run-to-run spread
TIED = dataclasses.replace(ZOO["small"], name="small-tied", tie_embeddings=True)
WIDE = dataclasses.replace(ZOO["tiny"], name="tiny-wide", hidden=256, ffn_hidden=768, vocab=4096)
DEEP = dataclasses.replace(ZOO["tiny"], name="tiny-deep", layers=16, hidden=256, ffn_hidden=768, vocab=1024)
# name: (model, world, sequence length, dtype, build_plan keywords); global batch 8 throughout
PLANS = {
    "small-dp4-zero3": (ZOO["small"], 4, 64, "fp32", dict(micro_batch=1, zero=3)),
    "small-dp4-zero3-full": (ZOO["small"], 4, 64, "fp32", dict(micro_batch=2, zero=3, recompute="full")),
    "small-dp4-zero3-s256": (ZOO["small"], 4, 256, "fp32", dict(micro_batch=2, zero=3)),
    "small-dp4-zero2": (ZOO["small"], 4, 64, "fp32", dict(micro_batch=1, zero=2)),
    "small-dp4-zero1": (ZOO["small"], 4, 64, "fp32", dict(micro_batch=1, zero=1)),
    "small-tied-dp4-zero3": (TIED, 4, 64, "fp32", dict(micro_batch=1, zero=3)),
    "tiny-dp4-zero3-full": (ZOO["tiny"], 4, 32, "fp32", dict(micro_batch=2, zero=3, recompute="full")),
    "small-dp2-zero3": (ZOO["small"], 2, 64, "fp32", dict(micro_batch=2, zero=3)),
    "small-dp2-zero3-one-mb": (ZOO["small"], 2, 64, "fp32", dict(micro_batch=4, zero=3)),
    "small-dp2-zero2-one-mb": (ZOO["small"], 2, 64, "fp32", dict(micro_batch=4, zero=2)),
    "deep-dp2-zero3": (DEEP, 2, 64, "fp32", dict(micro_batch=2, zero=3)),
    "wide-dp2-zero3": (WIDE, 2, 64, "fp32", dict(micro_batch=4, zero=3)),
    "tiny-dp2-zero3-selective": (ZOO["tiny"], 2, 32, "fp32", dict(micro_batch=4, zero=3, recompute="selective")),
    "small-dp4-zero3-bf16": (ZOO["small"], 4, 64, "bf16", dict(micro_batch=1, zero=3)),
    "small-dp4-zero3-bf16-one-mb": (ZOO["small"], 4, 64, "bf16", dict(micro_batch=2, zero=3)),
    "small-dp4-zero2-bf16": (ZOO["small"], 4, 64, "bf16", dict(micro_batch=1, zero=2)),
}


def rank_peaks(plan_path: Path, runs: Path) -> tuple:
    """(predicted, measured) peak bytes of each rank of a plan trained with --out runs/: the
    prediction priced for gloo (memory does not depend on the device's speed, so any shipped
    cluster reshaped to the plan's world size), the measurement run.json's."""
    import numpy as np
    plan = Plan.read(plan_path)
    world = plan.mesh.world_size
    cluster = dataclasses.replace(load_cluster("dgx-a100-80gb").shaped_as(1, world), backend="gloo")
    per_pp = estimate(plan, cluster).breakdown["memory_per_pp_rank"]
    measured = json.loads((runs / plan_path.name).read_text())["peak_memory_bytes_per_rank"]
    return (np.array([per_pp[plan.mesh.coords(r)["pp"]] for r in range(world)], dtype=float),
            np.array(measured, dtype=float))


def twin_rows(work: Path, plans, kinds: dict) -> list[dict]:
    """Per plan name, its two twins' rows (documents masked or not, dense or MoE): `kinds` maps the
    two keys (base first) to the suffix of their plan files (work/NAME-SUFFIX.json, run records in
    work/runs); each rank's measured / predicted peak under ratio_KEY, and the second twin's extra
    memory, predicted and measured, in MiB."""
    (a, sa), (b, sb) = kinds.items()
    rows = []
    for name in plans:
        (pa, ma), (pb, mb) = (rank_peaks(work / f"{name}-{s}.json", work / "runs") for s in (sa, sb))
        rows.append({"plan": name, f"ratio_{a}": list(ma / pa), f"ratio_{b}": list(mb / pb),
                     "predicted_extra_mib": list((pb - pa) / MiB), "measured_extra_mib": list((mb - ma) / MiB)})
    return rows


def extra_mib(row: dict) -> str:
    """A twin_rows row's extra MiB per rank, measured (predicted)."""
    return ", ".join(f"{m:+.2f} ({p:+.2f})" for m, p in zip(row["measured_extra_mib"], row["predicted_extra_mib"]))


def worst_ratio(rows: list[dict]) -> float:
    return max(max(v) for r in rows for k, v in r.items() if k.startswith("ratio_"))


def benchmark_args(argv, doc: str, prefix: str) -> tuple:
    """(arguments, work directory) of a memory benchmark: --keep DIR (else a temporary one) and --json."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--keep", default=None, help="write the plans, data and run records here")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    work = Path(args.keep or tempfile.mkdtemp(prefix=prefix))
    (work / "runs").mkdir(parents=True, exist_ok=True)
    return args, work


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", choices=sorted(PLANS), default=None)
    ap.add_argument("--keep", default=None, help="write the plans and run records here")
    ap.add_argument("--reuse", action="store_true", help="price the run records in --keep DIR, do not train")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.reuse and not args.keep:
        ap.error("--reuse needs --keep DIR (the folder of an earlier run)")
    work = Path(args.keep or tempfile.mkdtemp(prefix="trident-zero-memory-"))
    (work / "runs").mkdir(parents=True, exist_ok=True)
    groups: dict = {}
    for name in args.only or PLANS:
        model, world, seq, dtype, kw = PLANS[name]
        plan = build_plan(model, cluster_name="cpu-test", device="cpu", nodes=1, devices_per_node=world,
                          seq_len=seq, dtype=dtype, global_batch=8, **kw)
        path = work / f"{name}.json"
        plan.write(path)
        groups.setdefault((world, dtype), []).append(path)
    rows = []
    for (world, dtype), paths in groups.items():
        if args.reuse:
            missing = [p.name for p in paths if not (work / "runs" / p.name).exists()]
            if missing:
                sys.exit(f"--reuse: no run record of {', '.join(missing)} in {work / 'runs'}; run without --reuse")
        else:  # runtime.train trains float32 on a CPU unless told the plan's dtype; its --out names a
            # file for one plan, a folder for several
            out = work / "runs" / paths[0].name if len(paths) == 1 else work / "runs"
            torchrun(world, "runtime.train", "--plan", *paths, "--steps", 3, "--dtype", dtype, "--out", out)
        cluster = dataclasses.replace(load_cluster("dgx-a100-80gb").shaped_as(1, world), backend="gloo")
        for path in paths:
            breakdown = estimate(Plan.read(path), cluster).breakdown
            predicted = breakdown["memory_per_pp_rank"][0]  # no pipeline: every rank alike
            measured = json.loads((work / "runs" / path.name).read_text())["peak_memory_bytes_per_rank"]
            rows.append(dict(plan=path.stem, world=world, dtype=dtype, predicted_mib=predicted / MiB,
                             measured_mib=[m / MiB for m in measured], ratio=max(measured) / predicted,
                             peak_at=breakdown["memory"]["peak_at"]))
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        for r in rows:
            print(f"{r['plan']:28s} predicted {r['predicted_mib']:7.1f} MiB  measured "
                  f"{min(r['measured_mib']):7.1f}-{max(r['measured_mib']):7.1f} MiB  ratio {r['ratio']:.3f}"
                  f"  ({r['peak_at']})")
        ratios = sorted(r["ratio"] for r in rows)
        print(f"{len(rows)} plans: measured / predicted {ratios[0]:.3f} to {ratios[-1]:.3f}, "
              f"median {ratios[len(ratios) // 2]:.3f} (above {UNDER}: under-predicted)")
    return 1 if any(r["ratio"] > UNDER for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
