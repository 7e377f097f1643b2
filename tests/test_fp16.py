"""fp16 with dynamic loss scaling (runtime.loss_scale): the loss is scaled before the backward,
the gradients unscaled before clipping and the step, and a step whose gradients overflow is
skipped by every rank and the scale halved."""
from __future__ import annotations

import json
import math

import pytest

from torchrun_helpers import assert_ok, assert_same_losses, losses_of, train, write_plan

FP16_LOSS_REL = 1e-3  # plans compute in fp16 in different orders (the bf16 tests' tolerance)


def _run(path):
    return json.loads(path.read_text())


def test_fp16_plans_train_as_one_process_and_skip_overflowing_steps(tmp_path):
    one = write_plan(tmp_path, "one")
    assert_ok(train(1, "--plan", one, "--steps", 4, "--dtype", "fp16", "--out", tmp_path / "one.run.json"))
    assert_ok(train(1, "--plan", one, "--steps", 4, "--out", tmp_path / "fp32.json"))
    ref, fp32 = _run(tmp_path / "one.run.json"), _run(tmp_path / "fp32.json")
    assert ref["dtype"] == "fp16" and ref["loss_scales"] == [2.0 ** 16] * 4  # no overflow at the start
    assert ref["losses"] == pytest.approx(fp32["losses"], rel=FP16_LOSS_REL)
    assert ref["grad_norms"] == pytest.approx(fp32["grad_norms"], rel=1e-2)  # unscaled
    plans = [write_plan(tmp_path, "dp2-zero3", world=2, zero=3), write_plan(tmp_path, "pp2", world=2, pp=2),
             write_plan(tmp_path, "tp2-sp", world=2, tp=2, sequence_parallel=True, micro_batch=4)]
    out = tmp_path / "runs"
    out.mkdir()
    assert_ok(train(2, "--plan", *plans, "--steps", 4, "--dtype", "fp16", "--out", out))
    for plan in plans:
        got = _run(out / f"{plan.stem}.json")
        assert got["losses"] == pytest.approx(ref["losses"], rel=FP16_LOSS_REL), plan.stem
        assert got["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-2), plan.stem
    # from 2^24 the first three steps overflow (the loss's gradient alone exceeds fp16's 65504),
    # each halving the scale and leaving the model as it was: their losses and the next step's are
    # those of a run that skips every step (from 1e9); a checkpoint keeps the scale for a resume
    skips, none = tmp_path / "skips.json", tmp_path / "none.json"
    assert_ok(train(1, "--plan", one, "--steps", 6, "--dtype", "fp16", "--initial-loss-scale", 2 ** 24,
                    "--checkpoint-dir", tmp_path / "ckpt", "--checkpoint-every", 4, "--out", skips))
    assert_ok(train(1, "--plan", one, "--steps", 5, "--dtype", "fp16", "--initial-loss-scale", 1e9, "--out", none))
    run = _run(skips)
    assert [g is not None and math.isfinite(g) for g in run["grad_norms"][:4]] == [False, False, False, True]
    assert run["grad_norms"][:3] == [None] * 3  # an overflow's norm is null (JSON has no NaN)
    assert run["loss_scales"][:4] == [2.0 ** 23, 2.0 ** 22, 2.0 ** 21, 2.0 ** 21]
    # (the scaled loss is a float32: a scale of 2^24 or 1e9 rounds it at 1e-7)
    assert run["losses"][:4] == pytest.approx(losses_of(none)[:4], rel=1e-6)
    assert run["losses"][4] < losses_of(none)[4] - 0.05  # then it trains
    resumed = tmp_path / "resumed.json"
    assert_ok(train(1, "--plan", one, "--steps", 6, "--dtype", "fp16", "--checkpoint-dir", tmp_path / "ckpt",
                    "--resume", "--out", resumed))
    assert_same_losses(losses_of(resumed), run["losses"][4:], "fp16 resumed at step 4")
    assert _run(resumed)["loss_scales"] == run["loss_scales"][4:]


def test_trident_run_passes_fp16_and_its_loss_scale_through():
    from runtime import launch
    args = launch.train_args(launch.parse_args(["plan.json", "--dtype", "fp16", "--initial-loss-scale", "1024"]))
    assert args[args.index("--dtype") + 1] == "fp16" and float(args[args.index("--initial-loss-scale") + 1]) == 1024
