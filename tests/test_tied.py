"""Tied embeddings across pipeline stages (runtime.tied): the head's stage keeps a copy of the
embedding's matrix whose gradient is summed with the embedding's every step, as Megatron-LM keeps
one; the planner prices the copy and that all-reduce (planner.comm.tied_grad_comm)."""
from __future__ import annotations

import dataclasses
import json

import pytest

from planner.build import build_plan
from planner.cluster import load_cluster
from planner.comm import tied_grad_comm
from planner.cost import estimate
from planner.plan import Stage
from planner.precision import grad_bytes
from planner.zoo import ZOO
from torchrun_helpers import assert_ok, assert_same_losses, losses_of, train, write_plan

TIED = dataclasses.replace(ZOO["tiny-gpt"], name="tiny-gpt-tied", tie_embeddings=True)
A100 = load_cluster("dgx-a100-80gb", nodes=2)


def test_pipelines_of_a_tied_model_train_as_one_process(tmp_path):
    """pp 2 under 1F1B and ZB-V (whose rank 0 holds the embedding and the copy), pp 2 x tp 2
    interleaved with sequence parallelism, and pp 2 x dp 2 and pp 2 x cp 2 (ZeRO shards over the
    CP ranks) with ZeRO 0 on the embedding's stage and ZeRO 3 on the head's (the gradients summed
    whole): each step's loss is one process's. And
    pp 2 resumes the one process's checkpoint, whose one matrix is saved under both names."""
    ckpt = tmp_path / "ckpt"
    assert_ok(train(1, "--plan", write_plan(tmp_path, "one", TIED), "--steps", 3, "--out", tmp_path / "one.json",
                    "--checkpoint-dir", ckpt, "--checkpoint-every", 2))
    want = losses_of(tmp_path / "one.json")
    norms = json.loads((tmp_path / "one.json").read_text())["grad_norms"]
    two = [write_plan(tmp_path, "pp2", TIED, world=2, pp=2, schedule="1f1b"),
           write_plan(tmp_path, "zbv", TIED, world=2, pp=2, schedule="zbv")]
    mixed = [Stage(layers=[0, 3], zero=0, recompute=["none"] * 3), Stage(layers=[3, 6], zero=3, recompute=["none"] * 3)]
    four = [write_plan(tmp_path, "pp2-tp2", TIED, world=4, pp=2, tp=2, schedule="interleaved-1f1b",
                       virtual_stages=2, sequence_parallel=True),
            write_plan(tmp_path, "pp2-dp2", TIED, world=4, pp=2, schedule="1f1b", stages=mixed),
            write_plan(tmp_path, "pp2-cp2", TIED, world=4, pp=2, cp=2, schedule="1f1b", stages=mixed)]
    for world, plans in ((2, two), (4, four)):
        out = tmp_path / f"runs{world}"
        out.mkdir()
        assert_ok(train(world, "--plan", *plans, "--steps", 3, "--out", out))
        for plan in plans:
            assert_same_losses(losses_of(out / f"{plan.stem}.json"), want, plan.stem)
            # the matrix counted once in the norm (counted twice: 3.60 against 3.43 at step 1)
            got = json.loads((out / f"{plan.stem}.json").read_text())["grad_norms"]
            assert got == pytest.approx(norms, rel=1e-4), plan.stem
    assert_ok(train(2, "--plan", two[0], "--steps", 3, "--checkpoint-dir", ckpt, "--resume",
                    "--out", tmp_path / "resumed.json"))
    assert_same_losses(losses_of(tmp_path / "resumed.json"), want[2:], "pp 2 resumed at step 2")


def _est(model, **kw):
    kw = dict(cluster_name=A100.name, device=A100.device.name, nodes=2, devices_per_node=8, global_batch=64,
              micro_batch=1, seq_len=2048, **kw)
    plan = build_plan(model, **kw)
    return plan, estimate(plan, A100)


def test_a_pipeline_pays_the_all_reduce_of_the_tied_gradient_on_its_two_end_ranks():
    tied = ZOO["gpt-1.7b"]
    untied = dataclasses.replace(tied, tie_embeddings=False)
    plan, with_copy = _est(tied, pp=4, dp=4, zero=1)
    _, without = _est(untied, pp=4, dp=4, zero=1)
    comm = [tied_grad_comm(A100, plan, r, grad_bytes(plan.training)) for r in range(4)]
    # pp 4 x dp 4 on two nodes of 8: ranks 0 and 3 of the pipeline on different nodes; each
    # all-reduces its ZeRO shard of vocab x hidden float32 gradients
    assert comm[1] == comm[2] == 0.0 and comm[0] == comm[3] > 0.0
    assert comm[0] == pytest.approx(A100.collective_time("all_reduce", tied.vocab * tied.hidden * 4 / 4,
                                                         [plan.mesh.rank(pp=0), plan.mesh.rank(pp=3)]))
    assert with_copy.step_time_s - without.step_time_s == pytest.approx(comm[0], rel=1e-6)
    assert with_copy.breakdown["memory_per_pp_rank"] == pytest.approx(without.breakdown["memory_per_pp_rank"],
                                                                      rel=1e-12)


def test_zbv_keeps_the_copy_on_the_embeddings_rank_without_a_collective():
    """ZB-V's rank 0 runs the first and the last stage: two chunks, each with its matrix (the
    runtime cannot share one parameter between two FSDP2 roots), summed there in memory."""
    tied = ZOO["gpt-1.7b"]
    untied = dataclasses.replace(tied, tie_embeddings=False)
    plan, with_copy = _est(tied, pp=2, dp=8, zero=1, schedule="zbv")
    _, without = _est(untied, pp=2, dp=8, zero=1, schedule="zbv")
    assert tied_grad_comm(A100, plan, 0, 4) == 0.0
    assert with_copy.step_time_s == pytest.approx(without.step_time_s, rel=1e-12)
    assert with_copy.breakdown["memory_per_pp_rank"] == pytest.approx(without.breakdown["memory_per_pp_rank"],
                                                                      rel=1e-12)
