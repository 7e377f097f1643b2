"""The learning-rate schedule: warm-up and decay written into the plan, followed by the runtime."""
import json
import math
from types import SimpleNamespace

import pytest

from planner.build import build_plan
from planner.model import ConfigError
from planner.plan import Plan
from planner.zoo import ZOO
from runtime.optim import lr_at
from torchrun_helpers import assert_ok, losses_of, train, write_plan


def schedule(**kw):
    base = dict(lr=1e-3, lr_warmup_steps=0, lr_decay="constant", lr_decay_steps=0, min_lr=0.0)
    return SimpleNamespace(**{**base, **kw})


def test_warm_up_then_decay_to_the_minimum():
    t = schedule(lr_warmup_steps=4, lr_decay="cosine", lr_decay_steps=14, min_lr=1e-4)
    assert [lr_at(t, s) for s in range(4)] == pytest.approx([2e-4, 4e-4, 6e-4, 8e-4])  # lr (s + 1) / (w + 1)
    assert lr_at(t, 4) == pytest.approx(1e-3)
    assert lr_at(t, 9) == pytest.approx((1e-3 + 1e-4) / 2)  # halfway through the cosine
    assert lr_at(t, 14) == lr_at(t, 1000) == pytest.approx(1e-4)
    lin = schedule(lr_decay="linear", lr_decay_steps=10)
    assert [lr_at(lin, s) for s in (0, 5, 10, 11)] == pytest.approx([1e-3, 5e-4, 0.0, 0.0])
    assert lr_at(schedule(), 0) == lr_at(schedule(), 10**6) == 1e-3
    cos = [lr_at(t, s) for s in range(4, 15)]
    assert all(a > b for a, b in zip(cos, cos[1:]))


def _plan(**training):
    return build_plan(ZOO["tiny"], cluster_name="cpu-test", device="cpu", nodes=1, devices_per_node=1, global_batch=8,
                      micro_batch=2, dtype="fp32", **training)


@pytest.mark.parametrize("fields, field", [
    (dict(lr_decay="cosine"), "training.lr_decay_steps"),
    (dict(lr_decay="linear", lr_warmup_steps=5, lr_decay_steps=5), "training.lr_decay_steps"),
    (dict(lr_decay="step"), "training.lr_decay"),
    (dict(min_lr=1.0), "training.min_lr"),
    (dict(lr_warmup_steps=-1), "training.lr_warmup_steps"),
    (dict(lr_warmup_steps=1.5), "training.lr_warmup_steps"),
    (dict(min_lr=math.nan), "training.min_lr"),
])
def test_a_bad_schedule_names_its_field(fields, field):
    with pytest.raises(ConfigError, match=f"^{field}: "):
        _plan(**fields)


def test_a_schedule_round_trips_and_a_plan_without_one_is_written_as_before(tmp_path):
    plan = _plan(lr_warmup_steps=3, lr_decay="cosine", lr_decay_steps=20, min_lr=1e-5)
    plan.write(tmp_path / "a.json")
    again = Plan.read(tmp_path / "a.json")
    assert again.training == plan.training
    again.write(tmp_path / "b.json")
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    _plan().write(tmp_path / "c.json")
    assert not {"lr_warmup_steps", "lr_decay", "lr_decay_steps", "min_lr"} & set(json.loads((tmp_path / "c.json").read_text())["training"])


def test_the_runtime_follows_the_schedule_and_resumes_on_it(tmp_path):
    """Six steps of warm-up and cosine decay, checkpointed at step 3 and resumed: each step's rate is
    the schedule's, the resumed steps give the uninterrupted run's losses, and the rates change
    the training (a constant rate gives other losses from the second step on)."""
    fields = dict(lr=3e-3, lr_warmup_steps=2, lr_decay="cosine", lr_decay_steps=6, min_lr=3e-4)
    plan = write_plan(tmp_path, "sched", **fields)
    const = write_plan(tmp_path, "const", lr=3e-3)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert_ok(train(1, "--plan", plan, "--steps", 6, "--checkpoint-dir", straight, "--checkpoint-every", 3,
                    "--out", tmp_path / "straight.json"))
    (resumed / "step-3").parent.mkdir()
    (straight / "step-3").rename(resumed / "step-3")
    assert_ok(train(1, "--plan", plan, "--steps", 6, "--checkpoint-dir", resumed, "--resume",
                    "--out", tmp_path / "resumed.json"))
    assert_ok(train(1, "--plan", const, "--steps", 3, "--out", tmp_path / "const.json"))
    runs = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in ("straight", "resumed", "const")}
    want = [lr_at(schedule(**fields), s) for s in range(6)]
    assert runs["straight"]["learning_rates"] == pytest.approx(want)
    assert runs["resumed"]["learning_rates"] == pytest.approx(want[3:])
    assert losses_of(tmp_path / "resumed.json") == losses_of(tmp_path / "straight.json")[3:]
    sched, flat = losses_of(tmp_path / "straight.json"), losses_of(tmp_path / "const.json")
    assert sched[0] == flat[0] and sched[1] != flat[1]


def test_the_plan_summary_shows_a_schedule_only_where_there_is_one():
    from planner.report import describe_plan
    assert "learning rate" not in describe_plan(_plan())
    shown = describe_plan(_plan(lr_warmup_steps=3, lr_decay="linear", lr_decay_steps=9, min_lr=1e-5)).splitlines()[-1]
    assert shown == "learning rate 0.0003, warm-up 3 steps, linear decay to 1e-05 at step 9"


def test_weight_decay_falls_on_matrices_not_on_norms_and_biases():
    """runtime.optim.param_groups: AdamW decays linear weights and embeddings, not norm weights or
    biases (Megatron-LM's default); a step with zero gradients moves only the decayed ones, by
    lr x weight_decay of their value. reset_weight_decay restores the split after a checkpoint's
    hyperparameters were loaded over it."""
    import torch

    from runtime.model import Transformer
    from runtime.optim import param_groups, reset_weight_decay
    chunk = Transformer(ZOO["tiny-gpt"])
    groups = param_groups(chunk, 0.1)
    decayed = {id(p) for p in groups[0]["params"]}
    for name, p in chunk.named_parameters():
        assert (id(p) in decayed) == (name.endswith("weight") and "norm" not in name), name
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    before = {name: p.detach().clone() for name, p in chunk.named_parameters()}
    opt = torch.optim.AdamW(groups, lr=0.5, foreach=True)
    for p in chunk.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for name, p in chunk.named_parameters():
        want = before[name] * (1 - 0.5 * 0.1) if id(p) in decayed else before[name]
        assert torch.allclose(p, want), name
    for g in opt.param_groups:
        g["weight_decay"] = 0.3  # as a loaded checkpoint of another setting would leave them
    reset_weight_decay([opt], 0.1)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
