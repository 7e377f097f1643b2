"""trident compare: predicted against measured from a plan and its run record, notes on the
machine, and refusals in one line. The optimizer step: the run times the slowest rank's
(runtime.train optimizer_times_s), so the prediction it is compared with is the slowest pipeline
rank's too, not the critical rank's term of the step time (the demo's pp2 x dp2 plan showed -60%
from that mismatch alone)."""
from __future__ import annotations

import json

import pytest

from planner.build import build_plan
from planner.cluster import load_cluster
from planner.compare_cli import main as compare_main
from planner.cost import estimate
from planner.plan import Stage
from planner.zoo import ZOO

CLUSTER = load_cluster("dgx-a100-80gb")


def _plan_and_run(tmp_path, prediction=True, plan=None):
    """plan.json (the tiny model at tp 2, or `plan`; its prediction estimated, given, or left
    out) and a run.json of three steps recorded from it, in tmp_path."""
    cluster = CLUSTER
    if plan is None:
        plan = build_plan(ZOO["tiny"], cluster_name=cluster.name, device=cluster.device.name, nodes=1,
                          devices_per_node=2, global_batch=8, micro_batch=2, seq_len=32, tp=2, dtype="fp32",
                          profile_hash=cluster.profile_hash)
    if prediction is True:
        prediction = estimate(plan, cluster).to_dict()
    plan.prediction = prediction or None
    plan.write(tmp_path / "plan.json")
    run = {"losses": [6.3, 6.2, 6.1], "step_times_s": [0.5, 0.1, 0.12], "warmup_steps": 1,
           "peak_memory_bytes": 3_000_000, "peak_memory_bytes_per_rank": [3_000_000, 2_900_000],
           "optimizer_times_s": [0.05, 0.02, 0.03], "world_size": 2, "plan_hash": plan.content_hash()}
    (tmp_path / "run.json").write_text(json.dumps(run))
    return plan


def _compare(tmp_path, *flags, run=None) -> int:
    """compare_main on tmp_path's plan.json and run.json (rewritten from `run` when given)."""
    if run is not None:
        (tmp_path / "run.json").write_text(json.dumps(run))
    return compare_main([str(tmp_path / "plan.json"), str(tmp_path / "run.json"), *flags])


def _one_line_err(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    return err


@pytest.mark.parametrize("with_prediction", [True, False])
def test_compare_prints_predicted_against_measured(tmp_path, capsys, with_prediction):
    plan = _plan_and_run(tmp_path, with_prediction)
    assert _compare(tmp_path, "--json") == 0
    out = json.loads(capsys.readouterr().out)
    pred = estimate(plan, CLUSTER).step_time_s
    assert out["predicted_step_time_s"] == pytest.approx(pred)
    assert out["measured_step_time_s"] == pytest.approx(0.11)
    assert out["step_time_error"] == pytest.approx((pred - 0.11) / 0.11)
    assert out["measured_peak_memory_bytes"] == 3_000_000
    assert out["memory_error"] == pytest.approx((out["predicted_peak_memory_bytes"] - 3e6) / 3e6)
    # the optimizer step and the rest of the step, each the median over the timed steps
    assert out["measured_optimizer_s"] == pytest.approx(0.025)
    assert out["measured_forward_backward_s"] == pytest.approx(0.085)
    assert out["predicted_forward_backward_s"] + out["predicted_optimizer_s"] == pytest.approx(pred)
    assert _compare(tmp_path, "--plot", str(tmp_path / "c.png")) == 0
    assert (tmp_path / "c.png").stat().st_size > 0 and "step time" in capsys.readouterr().out


def test_compare_leaves_out_the_traced_step(tmp_path, capsys):
    """runtime.train --trace runs its last step under the profiler; compare times the plan without it."""
    _plan_and_run(tmp_path)
    run = json.loads((tmp_path / "run.json").read_text())
    run["traced_step_index"] = 2
    assert _compare(tmp_path, "--json", run=run) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["measured_step_time_s"] == pytest.approx(0.1) and out["measured_optimizer_s"] == pytest.approx(0.02)
    run["traced_step_index"] = "last"
    assert _compare(tmp_path, run=run) == 2
    err = _one_line_err(capsys)
    assert "run.traced_step_index" in err


def test_compare_notes_a_run_beside_other_work(tmp_path, capsys):
    """runtime.train records the cores other work kept busy while its ranks slept; compare says so."""
    _plan_and_run(tmp_path)
    run = json.loads((tmp_path / "run.json").read_text())
    for busy, noted in ((1.2, True), (0.1, False)):
        run.update(host_other_busy_cores=busy, host_cores=2)
        assert _compare(tmp_path, run=run) == 0
        out = capsys.readouterr().out
        assert ("note: the run: 1.2 of this machine's 2 CPU cores were busy with other work" in out) == noted
    run["host_other_busy_cores"] = "lots"
    assert _compare(tmp_path, run=run) == 2
    err = _one_line_err(capsys)
    assert "run.host_other_busy_cores" in err


def test_compare_notes_a_run_on_a_machine_that_changed_speed(tmp_path, capsys):
    """runtime.train measures compute_slots again before its steps; compare notes a run whose ranks
    computed together at another share of the cores than the profile it was priced with."""
    _plan_and_run(tmp_path)
    plan, run = (json.loads((tmp_path / f).read_text()) for f in ("plan.json", "run.json"))
    plan["prediction"]["breakdown"]["time"]["compute_slots"] = 1.9
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    for slots, noted in ((1.05, True), (1.8, False), (None, False)):
        run["host_compute_slots"] = slots
        assert _compare(tmp_path, run=run) == 0
        out = capsys.readouterr().out
        assert ("computed together at 1.05 full-speed slots, where the cluster profile priced 1.90" in out) == noted
    run["host_compute_slots"] = 0
    assert _compare(tmp_path, run=run) == 2
    err = _one_line_err(capsys)
    assert "run.host_compute_slots" in err


def test_compare_notes_memory_that_leaks(tmp_path, capsys):
    """runtime.train records what each rank holds after every step; compare notes a rank that held
    more after each step than the one before, from the memory-measuring step on, by more than 2%
    of its peak and 1 MiB a step (a pp 2 x tp 2 ZB-V plan keeping SP shards leaked 23.5 MiB a step,
    44% of its peak, until session 35)."""
    _plan_and_run(tmp_path)
    run = json.loads((tmp_path / "run.json").read_text())
    mib = 2**20
    for rank1, noted in (([100 * mib, 101 * mib, 103 * mib], True), ([100 * mib, 101 * mib, 101.01 * mib], False),
                         ([100 * mib, 101 * mib, 101.5 * mib], False)):  # 18% of the peak, under 1 MiB
        run.update(memory_held_after_step_bytes_per_rank=[[90 * mib] * 3, rank1], memory_step_index=1)
        assert _compare(tmp_path, "--json", run=run) == 0
        note = json.loads(capsys.readouterr().out)["memory_note"]
        assert (note is not None) == noted
        assert _compare(tmp_path, run=run) == 0
        out = capsys.readouterr().out
        assert ("note: the run: rank 1 held 2.0 MiB more after each of steps 3 to 3" in out) == noted, out
    run["memory_step_index"] = 2  # no step after the measured one: nothing to say
    assert _compare(tmp_path, run=run) == 0 and "leaks" not in capsys.readouterr().out
    for key, bad in (("memory_held_after_step_bytes_per_rank", [[1, -2]]), ("memory_step_index", 1.5)):
        assert _compare(tmp_path, run={**run, key: bad}) == 2
        assert f"run.{key}" in _one_line_err(capsys)


def test_compare_refuses_a_run_of_another_plan_in_one_line(tmp_path, capsys):
    _plan_and_run(tmp_path)
    run = json.loads((tmp_path / "run.json").read_text())
    run["plan_hash"] = "sha256:other"
    assert _compare(tmp_path, run=run) == 2
    err = _one_line_err(capsys)
    assert "plan_hash" in err


def test_compare_refuses_a_run_in_another_dtype_in_one_line(tmp_path, capsys):
    """A bf16 plan run on CPU computes in fp32 unless asked: its memory and time are not the
    plan's, so compare names the field and both fixes instead of printing errors of 2x."""
    _plan_and_run(tmp_path)
    run = json.loads((tmp_path / "run.json").read_text())
    for dtype, code in (("fp32", 0), ("bf16", 2)):
        run["dtype"] = dtype
        assert _compare(tmp_path, run=run) == code
    err = _one_line_err(capsys)
    assert "run.dtype" in err and "--dtype fp32" in err


def uneven_pipeline():
    """tiny (4 blocks) on pp2: the embedding and one block, then three blocks and the head; the
    second rank updates three times the parameters of the first."""
    recs = lambda n: ["none"] * n  # noqa: E731
    stages = [Stage(layers=[0, 2], zero=0, recompute=recs(2), sequence_parallel=False),
              Stage(layers=[2, 6], zero=0, recompute=recs(4), sequence_parallel=False)]
    return build_plan(ZOO["tiny"], cluster_name=CLUSTER.name, device=CLUSTER.device.name, nodes=1, devices_per_node=2,
                      global_batch=8, micro_batch=2, seq_len=32, pp=2, dtype="fp32", stages=stages,
                      profile_hash=CLUSTER.profile_hash)


def test_the_predicted_optimizer_step_is_the_slowest_ranks(tmp_path, capsys):
    plan = uneven_pipeline()
    est = estimate(plan, CLUSTER)
    per_rank = est.breakdown["optimizer_per_pp_rank_s"]
    tb = est.breakdown["time"]
    assert len(per_rank) == 2 and max(per_rank) == tb["optimizer_s"]  # after the pipeline ranks' norm
    assert per_rank[1] > 2 * per_rank[0]  # three blocks and the head against one block and the embedding
    _plan_and_run(tmp_path, est.to_dict(), plan)
    assert _compare(tmp_path, "--json") == 0
    out = json.loads(capsys.readouterr().out)
    assert out["predicted_optimizer_s"] == max(per_rank)
    assert out["predicted_forward_backward_s"] == pytest.approx(est.step_time_s - max(per_rank))


def test_each_stage_waits_for_the_last_backward_predicted_and_measured(tmp_path, capsys):
    """The first stage of the uneven pipeline drains the last backward while the second, three
    blocks and the head, waits for it in the gradient norm's all-reduce before its optimizer step:
    per stage, the prediction's wait and the run's (the median over its timed steps of the stage's
    longest), side by side."""
    plan = uneven_pipeline()
    est = estimate(plan, CLUSTER)
    waits = est.breakdown["optimizer_wait_per_pp_rank_s"]
    assert waits[0] == 0.0 and waits[1] > 0  # the first rank ends last
    _plan_and_run(tmp_path, est.to_dict(), plan)
    run = json.loads((tmp_path / "run.json").read_text())
    run["pipeline_wait_times_s_per_rank"] = [[0.0, 0.001, 0.0], [0.5, 0.004, 0.006]]  # the first step is warm-up
    assert _compare(tmp_path, "--json", run=run) == 0
    stages = json.loads(capsys.readouterr().out)["stages"]
    assert [s["measured_pipeline_wait_s"] for s in stages] == [0.0005, 0.005]
    assert [s["predicted_pipeline_wait_s"] for s in stages] == waits
    assert _compare(tmp_path, run=run) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "stage 1 waits for the last backward (ms)" in line)
    assert row.split()[-2:] == [f"{waits[1] * 1e3:.3g}", "5"]  # predicted, measured
    run["pipeline_wait_times_s_per_rank"] = [[0.0, 0.001], [0.5, 0.004]]  # a step short
    assert _compare(tmp_path, run=run) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "run.pipeline_wait_times_s_per_rank" in err[0]


@pytest.mark.parametrize("bad", [[], "fast", [0.1, -1.0], [None]])
def test_a_malformed_per_rank_optimizer_list_is_one_line(tmp_path, capsys, bad):
    plan = uneven_pipeline()
    prediction = estimate(plan, CLUSTER).to_dict()
    prediction["breakdown"]["optimizer_per_pp_rank_s"] = bad
    _plan_and_run(tmp_path, prediction, plan)
    assert _compare(tmp_path) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "prediction.breakdown.optimizer_per_pp_rank_s" in err[0]


def test_the_optimizer_row_leaves_out_the_collectives_before_the_step():
    """The run times its optimizer step without the all-reduces before it (the gradient norm's, the
    sequence-parallel norms' partial gradients'), which wait for the other ranks' backwards; so
    does the predicted row. The step and the breakdown's optimizer term still hold them."""
    from planner.comm import clip_norm_comm
    from planner.layers import sp_partial_params
    from planner.precision import grad_bytes
    cfg = ZOO["tiny"]
    plan = build_plan(cfg, cluster_name=CLUSTER.name, device=CLUSTER.device.name, nodes=1, devices_per_node=2,
                      global_batch=8, micro_batch=2, seq_len=32, tp=2, sequence_parallel=True, dtype="fp32",
                      profile_hash=CLUSTER.profile_hash)
    est = estimate(plan, CLUSTER)
    partial = sum(sp_partial_params(cfg, cfg.layer_kind(i)) for i in range(cfg.num_layers_total))
    comm = clip_norm_comm(CLUSTER, plan.mesh, 0, False, partial * grad_bytes(plan.training))
    assert comm > clip_norm_comm(CLUSTER, plan.mesh, 0, False) > 0
    assert est.breakdown["time"]["optimizer_s"] == pytest.approx(est.breakdown["optimizer_per_pp_rank_s"][0] + comm)


def test_compare_shows_an_moe_plans_load_factor_priced_and_measured(tmp_path, capsys):
    """run.json's moe_load_factor (runtime.moe.RoutingMeter): its median over the timed steps against
    the plan's training.moe_load_factor; a malformed one is a one-line error."""
    import dataclasses
    from planner.moe import MoESpec
    moe = dataclasses.replace(ZOO["tiny"], name="tiny-moe", moe=MoESpec(4, 2))
    plan = build_plan(moe, cluster_name=CLUSTER.name, device=CLUSTER.device.name, nodes=1, devices_per_node=2,
                      global_batch=8, micro_batch=2, seq_len=32, tp=2, dtype="fp32", moe_load_factor=1.2,
                      profile_hash=CLUSTER.profile_hash)
    _plan_and_run(tmp_path, plan=plan)
    run = json.loads((tmp_path / "run.json").read_text())
    assert _compare(tmp_path, "--json", run=dict(run, moe_load_factor=[1.9, 1.3, 1.5])) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["predicted_moe_load_factor"] == 1.2 and out["measured_moe_load_factor"] == pytest.approx(1.4)
    assert out["moe_load_factor_error"] == pytest.approx(-0.2 / 1.4)
    assert _compare(tmp_path) == 0 and "MoE load (busiest expert / mean)" in capsys.readouterr().out
    assert _compare(tmp_path, run=dict(run, moe_load_factor=[1.0, 0.5, 1.1])) == 2
    assert _one_line_err(capsys).startswith("trident: error: run.moe_load_factor: [1.0, 0.5, 1.1]")
    # under expert parallelism the busiest EP rank's too: 2 experts a rank, the other at the mean
    plan = build_plan(moe, cluster_name=CLUSTER.name, device=CLUSTER.device.name, nodes=1, devices_per_node=2,
                      global_batch=8, micro_batch=2, seq_len=32, zero=1, ep=2, dtype="fp32", moe_load_factor=1.2,
                      profile_hash=CLUSTER.profile_hash)
    _plan_and_run(tmp_path, plan=plan)
    run = json.loads((tmp_path / "run.json").read_text())
    ep_run = dict(run, moe_load_factor=[1.3] * 3, moe_rank_load_factor=[1.2, 1.1, 1.3])
    assert _compare(tmp_path, "--json", run=ep_run) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["predicted_moe_rank_load_factor"] == pytest.approx(1.1)
    assert out["measured_moe_rank_load_factor"] == pytest.approx(1.2)  # the timed steps' median
    assert _compare(tmp_path) == 0 and "busiest EP rank / mean" in capsys.readouterr().out


@pytest.mark.parametrize("where, key, value", [
    ("run", "peak_memory_bytes_per_rank", [1e30, 2_900_000]), ("run", "peak_memory_bytes", 1e30),
    ("prediction", "peak_memory_bytes", 1e30), ("memory", "memory_per_pp_rank", [1e12])])
def test_memory_no_device_holds_is_refused_in_one_line(tmp_path, capsys, where, key, value):
    """A byte count above 2^64, measured or predicted, or a stage's predicted peak above the plan's
    peak, is not a figure to compare against: one line naming it."""
    prediction = estimate(_plan_and_run(tmp_path), CLUSTER).to_dict()
    run = json.loads((tmp_path / "run.json").read_text())
    if where == "run":
        run[key] = value
    else:
        (prediction if where == "prediction" else prediction["breakdown"])[key] = value
        _plan_and_run(tmp_path, prediction)
    assert _compare(tmp_path, run=run) == 2
    assert f"{'run' if where == 'run' else 'prediction'}." in (err := _one_line_err(capsys)) and key in err, err


def test_a_plan_priced_on_a_profile_not_here_says_to_pass_it(tmp_path, capsys):
    """Re-pricing a plan whose cluster.name is a measured profile absent here (one made on another
    machine) names the fix, --cluster-profile."""
    plan = _plan_and_run(tmp_path)
    d = json.loads((tmp_path / "plan.json").read_text())
    d["cluster"]["name"] = "cpu-gloo-9"
    (tmp_path / "plan.json").write_text(json.dumps(d))
    run = json.loads((tmp_path / "run.json").read_text())
    run.pop("plan_hash")
    assert plan.cluster.name != "cpu-gloo-9" and _compare(tmp_path, "--model-profile", "x.json", run=run) == 2
    err = _one_line_err(capsys)
    assert "cluster.name: 'cpu-gloo-9' is neither a file nor a profile" in err and "as --cluster-profile" in err
