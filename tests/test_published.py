"""benchmarks/published.py, issue 2's first measure, run by the suite: every published row it
prices (the held-out files in benchmarks/, and shared/reference/published_runs.csv where it lies
beside this clone) is predicted and fits, each file's error stays within the figures the README
reports (a change that makes a set worse fails here; one that makes it better passes), and the
command prints its table."""
import csv
import importlib.util
import json

import pytest

from torchrun_helpers import REPO

_SPEC = importlib.util.spec_from_file_location("published", REPO / "benchmarks" / "published.py")
published = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(published)

# file: (MAPE, worst |error|) at most; measured at session 53 (README's accuracy table): 1.6% / 4.0%,
# 7.0% / 25.1%, 8.2% / 10.7%, 1.1%, 20.5% / 23.1% (predicted fast: routing imbalance unpriced),
# 6.1% / 6.9%; BLOOM's (on a cluster priced faster than it was) 19.4% / 34.4%; the FP8 runs 13.2% /
# 30.3% since session 55's sustained FP8 curves (17.2% before; the B200 rows 20-30% fast); the DGX
# Cloud recipes' BF16 and FP8 runs 12.9% / 28.2% (session 55; most rows fast). Session 56 priced ZeRO
# 1's gather beside the next forward (Megatron-LM's --overlap-param-gather, FSDP2's pre-forward
# gathers), which moves the rows predicted fast a little further: Mixtral 21.6% / 24.2%, FP8 13.4% /
# 30.8%, DGX Cloud 13.1% / 28.5%; and held out Megatron-Core's H100 weak-scaling table, 21.8% / 29.1%.
# Session 57 priced the gradients' reduction beside the last backward: FP8 14.2% / 30.8%, Megatron-Core
# 26.4% / 31.5%, torchtitan 14.4% / 17.5%, NeMo AutoModel 8.0% / 9.2%, MosaicML 7.1% / 25.5% (all fast).
# Session 58 priced compute slowed by the collectives beside it: FP8 13.9% / 29.9%, DGX Cloud 12.8% /
# 28.4%, Megatron-Core 23.6% / 30.6%, torchtitan 12.4% / 15.3%, NeMo AutoModel 5.4% / 7.2%, MosaicML
# 7.1% / 25.2%, Mixtral 21.4% / 24.0%, Llama 3 CP 1.1%. Session 60 priced H100, H200 and GB200 BF16
# products at their sustained rate (gpu-fryer, not the MAMF burst): DGX Cloud 9.6% / 22.1%,
# Megatron-Core 19.0% / 27.1%, Mixtral 16.5% / 19.3%, FP8 13.8% / 29.9% (all fast, less so); Meta's
# Llama 3 CP row +3.8% and NeMo AutoModel 6.0% / 10.3% (Qwen3 +7.2 -> +10.3%) move the other way.
# Session 61 priced Megatron-LM's default float32 cross-entropy (fused-fp32-loss): Megatron-Core 18.2% /
# 22.8%, Mixtral 15.9% / 18.7%, Korthikanti 1.6% / 4.1%, BLOOM 19.1% / 34.3%. Session 62 counted
# what fused SwiGLU keeps (3 ffn_hidden a token, not 4): Meta's Llama 3 CP row fits with selective
# recomputation, -5.9% (full: +3.8%); three 405B rows that ran now fit. Session 66 priced torchtitan's
# per-op selective recomputation (planner.sac) and added its three "selective op" rows and its two
# "selective layer" ones (every second block in full): torchtitan 14.3% / 17.8% (the five new rows
# -13.4% to -17.8%, as fast as its others), FP8 13.8% / 29.9%. Session 67 added KempnerForge's one-node H200
# runs: 13.1% / 24.9% (FSDP2 -1.3%, +2.8%; one GPU +8.8%; DTensor TP -16.2% to -24.9%). Session 68
# priced them on 4-GPU HGX H200 nodes (NVLink pairwise, 6 links a pair, no NVSwitch): 9.0% / 16.2%;
# then with KempnerForge's deferred gradient sync (training.defer_grad_sync): 9.1% / 16.2%.
CEILINGS = {
    "heldout_fp8.csv": (0.139, 0.30),
    "heldout_dgxc.csv": (0.098, 0.223),
    "heldout_megatron_core.csv": (0.184, 0.23),
    "heldout_runs.csv": (0.020, 0.045),
    "heldout_mosaicml.csv": (0.075, 0.255),
    "heldout_torchtitan.csv": (0.147, 0.181),
    "heldout_llama3_cp.csv": (0.06, 0.06),
    "heldout_moe.csv": (0.161, 0.19),
    "heldout_nemo_automodel.csv": (0.062, 0.105),
    "heldout_bloom.csv": (0.20, 0.35),
    "heldout_kempnerforge.csv": (0.092, 0.165),
}
# rows predicted not to fit though they ran: Megatron-Bridge 26.04.01's Llama 3.1 405B row on GB200 with
# current scaling (PP 16 x VP 4, no recomputation). Its MXFP8 row (VP 8) and the DGX Cloud recipes' two
# BF16 405B rows fit since session 62 counts fused SwiGLU's activations.
UNFIT = {"heldout_fp8.csv": 1}


def _rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("name", sorted(CEILINGS))
def test_every_held_out_row_is_predicted_within_what_the_readme_reports(name):
    path = REPO / "benchmarks" / name
    rows = _rows(path)
    out = published.predict_rows(rows)
    assert len(out) == len(rows) and all(r["error"] is not None for r in out), name
    assert sum(not r["fits"] for r in out) <= UNFIT.get(name, 0), name
    mape, worst = published.summary(out)
    assert mape <= CEILINGS[name][0] and worst <= CEILINGS[name][1], (name, mape, worst)


def test_the_published_runs_are_predicted_and_the_command_prints_them(capsys):
    """The issue's 15 rows (target MAPE <= 5%, worst <= 12%; measured 8.1% and 21.0%, MT-NLG's three
    rows 17.6-21.0% fast, the other 12 within 14.3%: Meta's two Llama 3 rows +11.8 and -14.3%, the
    second without recomputation as Meta ran it since session 62 counts fused SwiGLU's activations
    (+9.7% with full recomputation, which the memory model needed before), where the shared
    reference lies beside this clone; the command itself on a held-out file either way."""
    assert published.main(["--csv", str(REPO / "benchmarks" / "heldout_torchtitan.csv"), "--no-heldout"]) == 0
    assert "llama3-70b" in capsys.readouterr().out
    if not published.DEFAULT_CSV.exists():
        pytest.skip(f"{published.DEFAULT_CSV} is not beside this clone (the held-out files above ran)")
    assert published.main(["--no-heldout", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    rows = got["rows"]
    assert len(rows) == 15 and all(r["fits"] for r in rows)
    assert got["mape"] <= 0.082 and got["worst"] <= 0.22, (got["mape"], got["worst"])
    others = [abs(r["error"]) for r in rows if r["model"] != "mt-nlg-530b"]
    assert len(others) == 12 and max(others) <= 0.145, max(others)


def test_the_fp8_and_async_tp_speedups_are_priced():
    """benchmarks/fp8_speedup.py: the 9 published pairs (Float8, async TP) each priced a speedup,
    within the error measured (mean 2.0%, worst 6.6% since session 66 priced torchtitan's per-op
    selective recomputation, planner.sac; 3.3%, 8.8% since session 60's sustained H100 BF16 rate;
    5.0%, 8.6% since session 58; 5.3%, 8.1% since session
    55's sustained FP8 curves, which took the four FSDP Float8 pairs from 1-4% short to 6-7% short;
    4.4% / 8.1% before)."""
    spec = importlib.util.spec_from_file_location("fp8_speedup", REPO / "benchmarks" / "fp8_speedup.py")
    speedup = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(speedup)
    out = speedup.price(_rows(speedup.PAIRS_CSV))
    assert len(out) == 9 and all(r["predicted_speedup"] > 1 for r in out)
    errs = [abs(r["error"]) for r in out]
    assert sum(errs) / len(errs) <= 0.022 and max(errs) <= 0.068, errs
