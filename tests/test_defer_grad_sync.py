"""training.defer_grad_sync: ZeRO 2 and 3 reduce-scatter once a step, in the last micro-batch's
backward, the others accumulating unsharded gradients (FSDP2's set_requires_gradient_sync(False),
FSDP1's no_sync): what the planner prices and what two gloo processes hold and compute."""
from __future__ import annotations

import dataclasses
import json

import pytest

from planner.cli import main
from planner.cost import estimate
from planner.model import ConfigError
from planner.plan import Plan
from test_cost import A100, plan_for

ZERO3 = dict(nodes=2, tp=8, global_batch=8, micro_batch=1)  # dp 2, 4 micro-batches


def _est(**kw):
    return estimate(plan_for(**kw), A100)


def test_zero3_deferred_holds_whole_gradients_and_reduces_once():
    every, deferred = _est(zero=3, **ZERO3), _est(zero=3, defer_grad_sync=True, **ZERO3)
    m0, m1 = every.breakdown["memory"], deferred.breakdown["memory"]
    assert m1["gradients_bytes"] == pytest.approx(2 * m0["gradients_bytes"])  # unsharded over dp 2
    assert (m1["parameters_bytes"], m1["optimizer_bytes"]) == (m0["parameters_bytes"], m0["optimizer_bytes"])
    assert m0["other_parts"]["fsdp_buffers"] > 0 == m1["other_parts"]["fsdp_buffers"]  # no reduce input kept
    assert deferred.peak_memory_bytes > every.peak_memory_bytes
    # one reduce-scatter a step: less exposed beside the earlier backwards, the gathers unchanged
    assert deferred.step_time_s < every.step_time_s
    assert deferred.stages[0]["grad_sync_s"] == every.stages[0]["grad_sync_s"] > 0
    # one micro-batch: nothing to defer
    one = dict(ZERO3, global_batch=2)
    a, b = _est(zero=3, **one), _est(zero=3, defer_grad_sync=True, **one)
    assert (a.step_time_s, a.peak_memory_bytes) == (b.step_time_s, b.peak_memory_bytes)


def test_deferred_gradients_accumulate_in_the_reduce_dtype():
    """Without master weights (bf16 gradients, 2 bytes) FSDP2 still accumulates the deferred ones
    in its float32 reduce dtype; where gradients add up in 16 bits they stay in 2 bytes."""
    kw = dict(zero=3, master_weights=False, **ZERO3)
    params = _est(**kw).stages[0]["params"]
    grads = {acc: _est(defer_grad_sync=True, grad_accumulation=acc, **kw).breakdown["memory"]["gradients_bytes"]
             for acc in ("separate-fp32", "separate-16bit")}
    assert grads == {"separate-fp32": pytest.approx(4 * params), "separate-16bit": pytest.approx(2 * params)}
    assert _est(**kw).breakdown["memory"]["gradients_bytes"] == pytest.approx(2 * params / 2)  # bf16, sharded


def test_zero2_deferred_is_zero1():
    z1, z2 = _est(zero=1, **ZERO3), _est(zero=2, defer_grad_sync=True, **ZERO3)
    assert z2.step_time_s == pytest.approx(z1.step_time_s, rel=1e-12)
    assert z2.peak_memory_bytes == pytest.approx(z1.peak_memory_bytes, rel=1e-12)
    assert z2.breakdown["memory"]["gradients_bytes"] == z1.breakdown["memory"]["gradients_bytes"]
    assert _est(zero=2, **ZERO3).breakdown["memory"]["gradients_bytes"] < z1.breakdown["memory"]["gradients_bytes"]


def test_the_plan_file_keeps_it_and_refuses_what_cannot_run(tmp_path, capsys):
    plan = plan_for(zero=3, defer_grad_sync=True, **ZERO3)
    path = tmp_path / "p.json"
    plan.write(path)
    assert json.loads(path.read_text())["training"]["defer_grad_sync"] is True
    again = tmp_path / "q.json"
    Plan.read(path).write(again)
    assert again.read_bytes() == path.read_bytes()
    plan_for(zero=3, **ZERO3).write(path)
    assert "defer_grad_sync" not in json.loads(path.read_text())["training"]  # the default is not written
    bad = dataclasses.replace(plan, training=dataclasses.replace(plan.training, defer_grad_sync="yes"))
    with pytest.raises(ConfigError, match="training.defer_grad_sync"):
        bad.validate()
    with pytest.raises(ConfigError, match="training.defer_grad_sync: true is not for zbv"):
        plan_for(nodes=2, tp=4, pp=2, schedule="zbv", zero=3, global_batch=8, defer_grad_sync=True)
    argv = ["plan", "--model", "llama2-7b", "--cluster", "dgx-a100-80gb", "--nodes", "2", "--global-batch", "8",
            "--micro-batch", "1", "--tp", "8", "--seq-len", "2048", "--json", "--defer-grad-sync"]
    assert main([*argv, "--zero", "3"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["step_time_s"] == pytest.approx(_est(zero=3, defer_grad_sync=True, **ZERO3).step_time_s)
    assert main([*argv, "--zero", "1"]) == 0
    assert "--defer-grad-sync has no effect" in capsys.readouterr().err


def test_two_processes_train_alike_and_hold_the_unsharded_gradients(tmp_path):
    """Two gloo processes, ZeRO 3 and ZeRO 3 under a pipeline of 2, 2 micro-batches: with the sync
    deferred they reach the losses of one process and of the sync every micro-batch, hold more,
    within what the planner counts."""
    from planner.cluster import load_cluster
    from torchrun_helpers import assert_ok, assert_same_losses, losses_of, train, write_plan
    ref = write_plan(tmp_path, "ref")
    paths = [write_plan(tmp_path, "every", world=2, zero=3), write_plan(tmp_path, "deferred", world=2, zero=3,
                                                                        defer_grad_sync=True),
             write_plan(tmp_path, "pp-deferred", world=2, pp=2, zero=3, micro_batch=2, global_batch=4,
                        defer_grad_sync=True)]
    ref_pp = write_plan(tmp_path, "ref-pp", global_batch=4)
    (tmp_path / "runs").mkdir()
    assert_ok(train(1, "--plan", ref, ref_pp, "--steps", 3, "--out", tmp_path / "runs"))
    assert_ok(train(2, "--plan", *paths, "--steps", 3, "--out", tmp_path / "runs"))
    runs = {p.stem: json.loads((tmp_path / "runs" / f"{p.stem}.json").read_text()) for p in paths}
    for p, r in zip(paths, (ref, ref, ref_pp)):
        assert_same_losses(runs[p.stem]["losses"], losses_of(tmp_path / "runs" / f"{r.stem}.json"), p.stem)
    cluster = dataclasses.replace(load_cluster("dgx-a100-80gb").shaped_as(1, 2), backend="gloo")
    for p in paths:
        pred = estimate(Plan.read(p), cluster).peak_memory_bytes
        assert 0.85 * pred <= runs[p.stem]["peak_memory_bytes"] <= 1.03 * pred, (p.stem, runs[p.stem], pred)
    assert runs["deferred"]["peak_memory_bytes"] > runs["every"]["peak_memory_bytes"]


@pytest.mark.parametrize("zeros", [(0, 2, 3), (1, 3)])
def test_the_search_with_it_finds_what_enumerating_finds(zeros):
    """`trident search --defer-grad-sync`: the bounds price the gradients, copies and reduce-scatters
    as the estimate does, so at a limit just above each plan of the time-memory front the search
    finds what enumerating every plan finds; no zbv (refused with it)."""
    import math
    from test_search import _PRICED, _key, brute_force, check_same, plan_level, shrunk
    from planner.search import SearchSpace
    space = SearchSpace(pp=(1, 2), zero=zeros, zero_per_stage=False, recompute=("none", "full"),
                        recompute_granularity="plan", virtual_stages=(2,), sequence_parallel=(False,),
                        schedules=("1f1b", "interleaved-1f1b"))
    model, cluster, options = shrunk(4), A100.shaped_as(1, 4), plan_level(zeros, ("none", "full"))
    defer = dict(defer_grad_sync=True)
    everything = brute_force(model, cluster, 16, 1024, math.inf, space, options, **defer)
    front, fastest = [], math.inf
    for est in sorted(_PRICED[_key(model, cluster, 16, 1024, space, options, defer)], key=lambda e: e.required_bytes):
        if est.step_time_s < fastest:
            fastest = est.step_time_s
            front.append(est.required_bytes * (1 + 1e-7))
    assert len(front) > 3 and everything.step_time_s == fastest
    for limit in front:
        assert check_same(model, cluster, 16, 1024, limit, space, options, **defer).plan.training.defer_grad_sync


def test_the_search_bounds_stay_below_with_slow_reduce_scatters():
    """Deferred, ZeRO 2 and 3 reduce-scatter in the last backward alone: on 8 GPUs whose gathers
    and reduce-scatters are slow, every configuration's bounds stay below each assignment the inner
    problem can choose, and every assignment's LB below its estimate (test_bounds' check of the
    every-micro-batch reduce-scatters, with the sync deferred). ZeRO 2 and 3 alone: a bound that
    still counted every micro-batch's reduce-scatter fails here (ZeRO 0's cheaper all-reduce would
    hide it in the configuration's minimum)."""
    from test_bounds import check_bounds_on_slow_zero_communication
    check_bounds_on_slow_zero_communication((2, 3), defer_grad_sync=True)
