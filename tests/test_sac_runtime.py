"""The runtime's per-op selective recomputation (training.selective_recompute "ops": torchtitan's
policy, runtime.recompute.per_op_contexts; priced in planner.sac)."""
import dataclasses
import json

from planner.cluster import load_cluster
from planner.cost import estimate
from planner.plan import Plan
from planner.zoo import ZOO
from tests.torchrun_helpers import assert_ok, assert_same_losses, losses_of, train, write_plan


def test_per_op_plans_train_like_one_process_and_hold_what_the_planner_counts(tmp_path):
    """An 8-block model: one process, dp 2 under ZeRO 3, tp 2 with sequence parallelism (the
    kept shards off in those blocks: the checkpoint keeps none of what they save), cp 2, a 1F1B
    and an interleaved pipeline (pp 2 x dp 2): the losses of one process without recomputation,
    and the peak memory 0.85-1.03 of the prediction (measured 0.89-1.003; at tp 2 with SP 1.08
    while the kept shards stayed on, about what no recomputation keeps)."""
    deep = dataclasses.replace(ZOO["tiny"], name="tiny-deep", layers=8, hidden=256, ffn_hidden=768, vocab=1024)
    ops = dict(recompute="selective", selective_recompute="ops")
    runs = tmp_path / "runs"
    runs.mkdir()
    ref, one = write_plan(tmp_path, "ref", deep), write_plan(tmp_path, "one", deep, **ops)
    two = [write_plan(tmp_path, "dp2-zero3", deep, world=2, dp=2, zero=3, **ops),
           write_plan(tmp_path, "tp2-sp", deep, world=2, tp=2, sequence_parallel=True, zero=1, **ops),
           write_plan(tmp_path, "cp2", deep, world=2, cp=2, zero=1, **ops)]
    four = [write_plan(tmp_path, "pp2-dp2", deep, world=4, pp=2, dp=2, zero=1, micro_batch=1, **ops),
            write_plan(tmp_path, "pp2-dp2-interleaved", deep, world=4, pp=2, dp=2, zero=3, micro_batch=1,
                       schedule="interleaved-1f1b", virtual_stages=2, **ops)]
    for p in (ref, one):
        assert_ok(train(1, "--plan", p, "--steps", 3, "--out", runs / f"{p.stem}.json"))
    assert_ok(train(2, "--plan", *two, "--steps", 3, "--out", runs))
    assert_ok(train(4, "--plan", *four, "--steps", 3, "--out", runs))
    for p in [one, *two, *four]:
        run = json.loads((runs / f"{p.stem}.json").read_text())
        assert_same_losses(run["losses"], losses_of(runs / "ref.json"), p.stem)
        plan = Plan.read(p)
        cluster = dataclasses.replace(load_cluster("dgx-a100-80gb").shaped_as(1, plan.mesh.world_size), backend="gloo")
        for stage, pred in enumerate(estimate(plan, cluster).breakdown["memory_per_pp_rank"]):
            measured = max(m for r, m in enumerate(run["peak_memory_bytes_per_rank"])
                           if plan.mesh.coords(r)["pp"] == stage)
            assert 0.85 * pred <= measured <= 1.03 * pred, (p.stem, stage, measured / pred)
