"""What mixture-of-experts blocks hold on this machine, against the planner (about 1 minute).

    python benchmarks/moe_memory.py [--keep DIR] [--json]

The tiny model (4 blocks) with 8 experts, 2 a token, and a shared expert (runtime.moe; priced by
planner.moe) trains 4 steps under five plans beside its dense twin (the same blocks with one MLP
of ffn_hidden): one process, tp 2 with sequence parallelism, dp 2 under ZeRO 3 with full
recomputation, a 1F1B pipeline of 2, and dp 2 x tp 2 under ZeRO 1. Per rank it prints the
measured peak (run.json peak_memory_bytes_per_rank) over the prediction (planner.cost.estimate,
priced for gloo), and what the experts add, measured against predicted. Exit 1 where a rank
measures more than 1.03 of its prediction (the CPU heap's run-to-run spread,
benchmarks/zero_memory.py) or a run fails.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path


REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.prediction_accuracy import torchrun  # noqa: E402
from benchmarks.zero_memory import UNDER, benchmark_args, extra_mib, twin_rows, worst_ratio  # noqa: E402
from planner.build import build_plan  # noqa: E402
from planner.moe import MoESpec  # noqa: E402
from planner.zoo import ZOO  # noqa: E402

DENSE = dataclasses.replace(ZOO["tiny"], name="tiny-dense", seq_len=128)
MOE = dataclasses.replace(DENSE, name="tiny-moe", moe=MoESpec(8, 2, 128))
# name: (world, build_plan keywords); global batch 8, micro-batches of 2, float32
PLANS = {"one": (1, {}), "tp2-sp": (2, dict(tp=2, sequence_parallel=True)),
         "dp2-zero3-full": (2, dict(zero=3, recompute="full")), "pp2-1f1b": (2, dict(pp=2, schedule="1f1b")),
         "dp2-tp2-zero1": (4, dict(tp=2, zero=1))}


def main(argv=None) -> int:
    args, work = benchmark_args(argv, __doc__, "trident-moe-memory-")
    by_world: dict = {}
    for name, (world, kw) in PLANS.items():
        for model in (DENSE, MOE):
            plan = build_plan(model, cluster_name="cpu-test", device="cpu", nodes=1, devices_per_node=world,
                              seq_len=128, dtype="fp32", global_batch=8, micro_batch=2, **kw)
            path = work / f"{name}-{model.name}.json"
            plan.write(path)
            by_world.setdefault(world, []).append(path)
    for world, paths in by_world.items():
        torchrun(world, "runtime.train", "--plan", *paths, "--steps", 4, "--out", work / "runs")
    rows = twin_rows(work, PLANS, {"dense": DENSE.name, "moe": MOE.name})
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(f"{MOE.name}: {MOE.num_parameters() / 1e6:.2f} M parameters ({MOE.active_parameters() / 1e6:.2f} M "
              f"active), its dense twin {DENSE.num_parameters() / 1e6:.2f} M; 128 tokens, micro-batches of 2, fp32")
        for r in rows:
            print(f"{r['plan']:15s} measured/predicted: dense {max(r['ratio_dense']):.3f}, MoE "
                  f"{min(r['ratio_moe']):.3f}-{max(r['ratio_moe']):.3f}; the experts' extra MiB per rank, "
                  f"measured (predicted): {extra_mib(r)}")
    return 1 if worst_ratio(rows) > UNDER else 0


if __name__ == "__main__":
    sys.exit(main())
