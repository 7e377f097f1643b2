"""The held-out MosaicML rows' error against the share of their block time in fused attention,
by head size: each row as benchmarks/published.py prices it, with its block's forward, backward
and (under full recomputation) replayed forward split into the attention core (its kernel's rate
at that sequence length and head size, planner.device.attention_flops_per_s) and the rest (GEMMs
and memory-bound operations), on one layer of the row's plan.

    python benchmarks/attention_share.py [--csv benchmarks/heldout_mosaicml.csv]
"""
from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import published  # noqa: E402
from planner.cluster import load_cluster  # noqa: E402
from planner.layers import attention_core_hw_flops, layer_cost  # noqa: E402


def share(plan, cluster) -> float:
    """Attention core's share of a block's time (forward, backward, a full recompute's replay)."""
    m, t = plan.model, plan.training
    st = plan.pipeline.stages[0]
    cost = layer_cost(plan, cluster, 1, st, [0])
    rate = cluster.device.attention_flops_per_s(t.dtype, t.seq_len, m.dim_per_head, t.attention)
    fwd, bwd = (f / plan.mesh.tp / rate for f in attention_core_hw_flops(m, t.micro_batch, t.seq_len, t.attention))
    core = fwd + bwd + (fwd if st.recompute[1] == "full" else 0.0)
    return core / (cost.fwd_compute_s + cost.bwd_compute_s)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv", default=str(ROOT / "benchmarks" / "heldout_mosaicml.csv"))
    args = ap.parse_args(argv)
    rows = list(csv.DictReader(open(args.csv)))
    print(f"{'model':10s} {'head':>4s} {'seq':>6s} {'recompute':9s} {'attention':>9s} {'error':>7s}")
    for row in sorted(rows, key=lambda r: (int(r["hidden"]) // int(r["heads"]), r["model"], int(r["seq_len"]))):
        model, best = published.predict_row(row)
        _, est, plan = best
        cluster = load_cluster(row["cluster"], nodes=max(1, int(row["gpus"]) // 8))
        err = est.step_time_s / published.published_step_time(row, model) - 1
        print(f"{row['model']:10s} {model.dim_per_head:4d} {int(row['seq_len']):6d} {row['recompute']:9s} "
              f"{share(plan, cluster):9.0%} {err:+7.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
