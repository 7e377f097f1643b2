"""What a document mask costs in memory on this machine, against the planner (about 1 minute).

    python benchmarks/document_mask.py [--keep DIR] [--json]

Each plan of the tiny model at 256 tokens (grouped-query heads, so the repeated K and V are
priced too: planner.layers.repeated_kv_bytes) trains 3 steps twice, with and without
training.document_mask, on a token file of documents of 3 to 40 tokens (its side file names the
end-of-text id): one process, a 1F1B pipeline of 2, tp 2 with sequence parallelism, dp 2 under
ZeRO 3. Per rank it prints the measured peak (run.json peak_memory_bytes_per_rank) over the
prediction (planner.cost.estimate, priced for gloo; memory does not depend on the device's speed,
so any shipped cluster reshaped to the plan's world size), and the mask's extra memory measured
against predicted (planner.memory.document_mask_bytes: [rows, 1, s, s] in the compute dtype a
micro-batch in flight). Exit 1 where a rank measures more than 1.03 of its prediction (the CPU
heap's run-to-run spread, benchmarks/zero_memory.py) or a run fails.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.prediction_accuracy import torchrun  # noqa: E402
from benchmarks.zero_memory import UNDER, benchmark_args, extra_mib, twin_rows, worst_ratio  # noqa: E402
from planner.build import build_plan  # noqa: E402
from planner.zoo import ZOO  # noqa: E402

MiB = 2**20
EOS = 7
MODEL = dataclasses.replace(ZOO["tiny"], name="tiny-256", seq_len=256)
# name: (world, build_plan keywords); global batch 8, micro-batches of 2, float32
PLANS = {"one": (1, {}), "pp2-1f1b": (2, dict(pp=2, schedule="1f1b")),
         "tp2-sp": (2, dict(tp=2, sequence_parallel=True)), "dp2-zero3": (2, dict(zero=3))}


def token_file(path: Path) -> Path:
    rng, ids = np.random.default_rng(0), []
    while len(ids) < 50_000:
        ids += rng.integers(8, MODEL.vocab, rng.integers(3, 41)).tolist() + [EOS]
    np.asarray(ids, dtype=np.uint16).tofile(path)
    path.with_name(path.name + ".json").write_text(json.dumps({"dtype": "uint16", "eos_id": EOS}))
    return path


def main(argv=None) -> int:
    args, work = benchmark_args(argv, __doc__, "trident-document-mask-")
    data = token_file(work / "docs.bin")
    by_world: dict = {}
    for name, (world, kw) in PLANS.items():
        for masked in (False, True):
            plan = build_plan(MODEL, cluster_name="cpu-test", device="cpu", nodes=1, devices_per_node=world,
                              seq_len=256, dtype="fp32", global_batch=8, micro_batch=2, document_mask=masked, **kw)
            path = work / f"{name}-{'masked' if masked else 'plain'}.json"
            plan.write(path)
            by_world.setdefault(world, []).append(path)
    for world, paths in by_world.items():
        torchrun(world, "runtime.train", "--plan", *paths, "--steps", 3, "--data", data, "--out", work / "runs")
    rows = twin_rows(work, PLANS, {"plain": "plain", "masked": "masked"})
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(f"{MODEL.name}, 256 tokens, micro-batches of 2 (the mask: {2 * 256 ** 2 * 4 / MiB:.2f} MiB a "
              "micro-batch in float32)")
        for r in rows:
            print(f"{r['plan']:10s} measured/predicted: plain {max(r['ratio_plain']):.3f}, masked "
                  f"{max(r['ratio_masked']):.3f}; the mask's extra MiB per rank, measured (predicted): {extra_mib(r)}")
    return 1 if worst_ratio(rows) > UNDER else 0


if __name__ == "__main__":
    sys.exit(main())
