"""A checkpoint resumes under any plan of the same run: its state is keyed by parameter name and
DCP reshards it (runtime.checkpoint)."""
from __future__ import annotations

import json
import shutil

import pytest

from planner.model import ConfigError
from runtime import checkpoint
from torchrun_helpers import assert_ok, assert_same_losses, losses_of, train, write_plan


def test_a_checkpoint_resumes_under_other_plans_of_the_run(tmp_path):
    """One process trains 4 steps (a checkpoint at step 2); pp 2 x tp 2 with sequence parallelism,
    interleaved (two chunks a rank: TP DTensors from plain tensors), resumes at step 2 (a
    checkpoint at step 3); dp 2 under ZeRO 3 with full recompute and micro-batches of one resumes
    at step 3 (FSDP shards from TP shards). Each resumed step's loss is the uninterrupted run's."""
    one = write_plan(tmp_path, "one", world=1)
    pp_tp = write_plan(tmp_path, "pp2-tp2", world=4, pp=2, tp=2, schedule="interleaved-1f1b", virtual_stages=2,
                       sequence_parallel=True)
    zero3 = write_plan(tmp_path, "zero3", world=2, zero=3, recompute="full", micro_batch=1)
    ckpt = {name: tmp_path / name for name in ("straight", "pp", "dp")}
    assert_ok(train(1, "--plan", one, "--steps", 4, "--checkpoint-dir", ckpt["straight"], "--checkpoint-every", 2,
                    "--out", tmp_path / "straight.json"))
    want = losses_of(tmp_path / "straight.json")
    shutil.copytree(ckpt["straight"] / "step-2", ckpt["pp"] / "step-2")
    proc = train(4, "--plan", pp_tp, "--steps", 3, "--checkpoint-dir", ckpt["pp"], "--resume", "--checkpoint-every", 1,
                 "--out", tmp_path / "pp.json")
    assert_ok(proc)
    assert "resumed step-2 of another plan of this run (pp 1 dp 1 tp 1, 1 stage, ZeRO 0; now pp 2 dp 1 tp 2" \
        in proc.stdout
    shutil.copytree(ckpt["pp"] / "step-3", ckpt["dp"] / "step-3")
    assert_ok(train(2, "--plan", zero3, "--steps", 4, "--checkpoint-dir", ckpt["dp"], "--resume",
                    "--out", tmp_path / "dp.json"))
    assert_same_losses(losses_of(tmp_path / "pp.json"), want[2:3], "pp 2 x tp 2 resumed at step 2")
    assert_same_losses(losses_of(tmp_path / "dp.json"), want[3:], "dp 2 ZeRO 3 resumed at step 3")


def test_a_checkpoint_of_an_earlier_trident_is_refused_by_name(tmp_path):
    step = tmp_path / "step-5"
    step.mkdir()
    (step / "trident.json").write_text(json.dumps({"plan_hash": "sha256:0", "step": 5, "data": {"next_step": 5}}))
    from planner.plan import Plan
    plan = Plan.read(write_plan(tmp_path, "one"))
    with pytest.raises(ConfigError, match=r"step-5/trident.json: written by trident before 2026-12-04"):
        checkpoint.read_meta(step, plan)


def test_asynchronous_checkpoints_resume_exactly_and_a_run_without_interval_saves_its_end(tmp_path):
    """--async-checkpoint: each step's state is written by a background thread while the next steps
    train (one process, then dp 2 under ZeRO 3 resuming its step-2 and saving asynchronously
    again); every checkpoint is complete (no step-N.tmp left) and resumes to the uninterrupted run's
    losses. Without --checkpoint-every the run saves once, after its last step. --metrics appends
    a line a step and a validation as the run goes, the resumed run to the same file;
    --keep-checkpoints 2 leaves the newest two."""
    one = write_plan(tmp_path, "one", world=1)
    zero3 = write_plan(tmp_path, "zero3", world=2, zero=3, micro_batch=1)
    a, b, end = tmp_path / "a", tmp_path / "b", tmp_path / "end"
    metrics = tmp_path / "logs" / "metrics.jsonl"
    assert_ok(train(1, "--plan", one, "--steps", 4, "--checkpoint-dir", a, "--checkpoint-every", 1,
                    "--async-checkpoint", "--out", tmp_path / "straight.json", "--metrics", metrics, "--eval-every", 2))
    want = losses_of(tmp_path / "straight.json")
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 2, 3, 4, 4] and [x["loss"] for x in lines if "loss" in x] == want
    assert [x["validation_loss"] for x in lines if "validation_loss" in x] == [
        v["loss"] for v in json.loads((tmp_path / "straight.json").read_text())["validation"]]
    assert all(x["step_time_s"] > 0 and x["tokens_per_s"] > 0 and x["lr"] > 0 for x in lines if "loss" in x)
    assert sorted(p.name for p in a.iterdir()) == ["step-1", "step-2", "step-3", "step-4"]
    assert all((p / "trident.json").is_file() for p in a.iterdir())
    shutil.copytree(a / "step-2", b / "step-2")
    assert_ok(train(2, "--plan", zero3, "--steps", 4, "--checkpoint-dir", b, "--resume", "--checkpoint-every", 1,
                    "--async-checkpoint", "--out", tmp_path / "resumed.json", "--metrics", metrics,
                    "--keep-checkpoints", 2))
    assert_same_losses(losses_of(tmp_path / "resumed.json"), want[2:], "dp 2 ZeRO 3 resumed at step 2")
    assert sorted(p.name for p in b.iterdir()) == ["step-3", "step-4"]
    resumed = [json.loads(x) for x in metrics.read_text().splitlines()][6:]
    assert [x["step"] for x in resumed] == [3, 4] and [x["loss"] for x in resumed] == losses_of(tmp_path / "resumed.json")
    assert_ok(train(1, "--plan", one, "--steps", 2, "--checkpoint-dir", end))
    assert [p.name for p in end.iterdir()] == ["step-2"]


@pytest.mark.parametrize("data, words", [
    ({"next_step": -3}, "data.next_step -3 are not the step counts"),
    ({"next_step": 1.5}, "data.next_step 1.5"),
    ({"next_step": True}, "data.next_step True"),
    ({"next_step": 2, "loss_scale": "x"}, "data.loss_scale 'x' is not a positive scale"),
    ({"next_step": 2, "loss_scale": {"scale": 0, "good_steps": 0}}, "is not a positive scale"),
    ({"next_step": 2, "loss_scale": {"scale": -5.0, "good_steps": 0}}, "is not a positive scale"),
    ({"next_step": 2, "loss_scale": {"scale": "abc", "good_steps": 0}}, "is not a positive scale"),
])
def test_a_checkpoint_whose_counts_cannot_be_is_corrupt_in_one_line(tmp_path, data, words):
    """trident.json's step counts and fp16 loss scale are checked before they are used: a negative
    or fractional next step trained from it, a loss scale of 0 divided by zero, a string crashed."""
    from planner.plan import Plan
    plan = Plan.read(write_plan(tmp_path, "one", world=1))
    ckpt = tmp_path / "step-2"
    ckpt.mkdir()
    meta = {"plan_hash": plan.content_hash(), "layout": checkpoint.BY_NAME, "run": checkpoint.run_of(plan),
            "step": 2, "data": data}
    (ckpt / checkpoint.META).write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match=f"checkpoint .*unreadable or corrupt .*{words}"):
        checkpoint.read_meta(ckpt, plan)
    meta["data"] = {"next_step": 2, "loss_scale": {"scale": 65536.0, "good_steps": 3}}
    (ckpt / checkpoint.META).write_text(json.dumps(meta))
    assert checkpoint.read_meta(ckpt, plan)["next_step"] == 2
