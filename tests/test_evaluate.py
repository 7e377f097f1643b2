"""Validation loss during training (runtime.evaluate): forward only under every plan's parallelism,
the same figures as one process, the training steps untouched; and its options refused by name."""
from __future__ import annotations

import json

import numpy as np

from planner.zoo import ZOO
from torchrun_helpers import assert_ok, assert_same_losses, train, write_plan

FLAGS = ("--steps", 4, "--eval-every", 2, "--eval-batches", 2)


def _validation(path) -> list[float]:
    run = json.loads(path.read_text())
    assert [v["step"] for v in run["validation"]] == [2, 4]
    return [v["loss"] for v in run["validation"]]


def test_validation_losses_are_one_processs_under_every_plan(tmp_path):
    """One process, with dropout 0.1 (off while validating) and without validation: the same
    training losses. pp 2 under 1F1B, interleaved 1F1B and ZB-V, tp 2 with SP, dp 2 under ZeRO 1
    and 3, cp 2: each gives one process's training and validation losses."""
    d = tmp_path / "plans"
    d.mkdir()
    gpt = "tiny-gpt"
    one = write_plan(d, "one", gpt, dropout=0.1)
    assert_ok(train(1, "--plan", one, *FLAGS, "--out", tmp_path / "one.json"))
    assert_ok(train(1, "--plan", one, "--steps", 4, "--out", tmp_path / "plain.json"))
    want = json.loads((tmp_path / "one.json").read_text())["losses"]
    assert json.loads((tmp_path / "plain.json").read_text())["losses"] == want  # validating changes nothing
    valid = _validation(tmp_path / "one.json")
    assert valid[1] < valid[0] < want[0]  # the synthetic language is learned; no dropout while validating
    two = [write_plan(d, "pp2", gpt, world=2, pp=2, schedule="1f1b", dropout=0.1),
           write_plan(d, "zbv", gpt, world=2, pp=2, schedule="zbv", dropout=0.1, attention_dropout=0.0),
           write_plan(d, "tp2-sp", gpt, world=2, tp=2, sequence_parallel=True, dropout=0.1, attention_dropout=0.0),
           write_plan(d, "dp2-zero1", gpt, world=2, zero=1, micro_batch=1, dropout=0.1, attention_dropout=0.0),
           write_plan(d, "cp2-zero3", gpt, world=2, cp=2, zero=3, dropout=0.1, attention_dropout=0.0)]
    four = [write_plan(d, "pp2-dp2-interleaved", gpt, world=4, pp=2, schedule="interleaved-1f1b", virtual_stages=2,
                       zero=3, dropout=0.1)]
    hidden = write_plan(d, "one-hidden", gpt, dropout=0.1, attention_dropout=0.0)
    assert_ok(train(1, "--plan", hidden, *FLAGS, "--out", tmp_path / "one-hidden.json"))
    assert_ok(train(2, "--plan", *two, *FLAGS, "--out", tmp_path))
    assert_ok(train(4, "--plan", *four, *FLAGS, "--out", tmp_path / f"{four[0].stem}.json"))
    for plan in two + four:
        run = tmp_path / f"{plan.stem}.json"
        ref = tmp_path / ("one.json" if plan.stem in ("pp2", "pp2-dp2-interleaved") else "one-hidden.json")
        assert_same_losses(json.loads(run.read_text())["losses"], json.loads(ref.read_text())["losses"], plan.stem)
        assert_same_losses(_validation(run), _validation(ref), f"{plan.stem} validation")


def test_validation_options_are_checked_by_name(tmp_path):
    plan = write_plan(tmp_path, "p")
    tokens = tmp_path / "train.bin"
    np.arange(4096, dtype=np.uint16).__mod__(ZOO["tiny"].vocab).astype(np.uint16).tofile(tokens)
    cases = [(("--data", tokens, "--eval-every", 2), "--eval-data: needed"),
             (("--eval-data", tmp_path / "missing.bin", "--eval-every", 2), "--eval-data: "),
             (("--eval-data", tokens), "--eval-data needs --eval-every"),
             (("--eval-every", -1), "--eval-every"),
             (("--eval-data", tmp_path / "short.bin", "--eval-every", 2), "--eval-data: ")]  # its checks, named so
    np.arange(8, dtype=np.uint16).tofile(tmp_path / "short.bin")
    for extra, words in cases:
        proc = train(1, "--plan", plan, "--steps", 2, *extra)
        assert proc.returncode != 0 and words in proc.stderr and "Traceback" not in proc.stderr, (extra, proc.stderr)
    # a held-out token file: its batches, the same at each validation
    assert_ok(train(1, "--plan", plan, "--data", tokens, "--eval-data", tokens, *FLAGS, "--out", tmp_path / "r.json"))
    assert len(_validation(tmp_path / "r.json")) == 2
