"""What FP8 linears and overlapped TP collectives gain, priced against what their authors measured.

torchtitan's and torchao's H100 tables publish each run with and without Float8 (torchao's
tensorwise recipe) and with and without async TP on the same machines (benchmarks/speedup_pairs.csv):
500 W-capped 96 GB H100s, a part no shipped profile describes, so their step times are not held
out (benchmarks/published.py); the ratio of a pair's throughputs is, priced on dgx-h100-80gb. The
pairs (each row: the run, then what the variant changes; tokens/s per GPU as published):
- torchtitan benchmarks/llama3_h100_202412_torchtitan.md at 820504e2, Tables 1 and 3: Llama 3.1
  8B on 8 and 128 GPUs, FSDP, torch.compile, per-op selective checkpointing, local batch 2,
  without and with Float8 (FP8 all-gathers, as torchtitan's docs/float8.md recommends: inferred);
- torchao docs/source/workflows/training.md at 36027d82, "NVIDIA H100": Llama 3 8B on 8 GPUs,
  FSDP2, compile, per-op SAC, batch 1, bfloat16 and tensorwise (its launcher benchmarks/float8/
  training/llama3.sh enables the FP8 all-gather);
- torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md at b5bcd76c: Llama 3 70B on 256
  GPUs (FSDP 32 x TP 8, compile, full AC, local batch 16) and 8B on 64 (FSDP 8 x TP 8, per-op
  SAC, local batch 12), bfloat16 and tensorwise, each with vanilla and async TP
  (training.tp_comm_overlap); the FP8 all-gather is off in that commit's llama3 tomls.
Sequences of 8192 tokens (the train configs' seq_len: inferred where the tables do not say);
per-op selective checkpointing priced as selective (it also recomputes every second matmul).

    python benchmarks/fp8_speedup.py [--csv PATH] [--json]
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import published  # noqa: E402

PAIRS_CSV = ROOT / "benchmarks" / "speedup_pairs.csv"
CLUSTER = "dgx-h100-80gb"
VARIANT = ("fp8", "fp8_param_gather", "tp_comm_overlap")


def as_row(pair: dict, base: bool) -> dict:
    """The pair's base or variant run as a published.py row, its step time from its tokens/s."""
    tps = float(pair["published_base_tps" if base else "published_tps"])
    row = dict(pair, arch="llama", cluster=CLUSTER, pp="1", cp="1", ep="1", zero="3", schedule="1f1b", dtype="bf16",
               published_step_time_s=str(int(pair["global_batch"]) * int(pair["seq_len"]) / (tps * int(pair["gpus"]))),
               micro_batch=pair["micro_batch"], published_tflops_per_gpu="")
    for k in VARIANT:
        row[k] = pair[f"base_{k}"] if base else pair[k]
    return row


def price(pairs: list[dict]) -> list[dict]:
    out = []
    for p in pairs:
        base, var = (published.predict_row(as_row(p, b))[1] for b in (True, False))
        published_x = float(p["published_tps"]) / float(p["published_base_tps"])
        predicted_x = base[1].step_time_s / var[1].step_time_s
        out.append(dict(pair=p["pair"], published_speedup=published_x, predicted_speedup=predicted_x,
                        error=predicted_x / published_x - 1, base_step_s=base[1].step_time_s,
                        variant_step_s=var[1].step_time_s))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv", default=str(PAIRS_CSV))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    with open(args.csv) as f:
        out = price(list(csv.DictReader(f)))
    errs = [abs(r["error"]) for r in out]
    mean = sum(errs) / len(errs)
    if args.json:
        print(json.dumps({"pairs": out, "mean_abs_error": mean}, indent=2))
        return 0
    print(f"{'pair':28s} {'published':>9s} {'predicted':>9s} {'error':>7s}")
    for r in out:
        print(f"{r['pair']:28s} {r['published_speedup']:9.3f} {r['predicted_speedup']:9.3f} {r['error']:+7.1%}")
    print(f"\npairs: {len(out)}  speedup error: mean {mean:.1%}, worst {max(errs):.1%} (priced on {CLUSTER})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
