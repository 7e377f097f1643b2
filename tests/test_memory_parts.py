"""What a plan's "other" memory holds (breakdown.memory.other_parts): the parts add up to it on
every pipeline rank and moment, and each part appears where the plan has what makes it."""
import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from planner import cost
from planner.cluster import load_cluster
from planner.cost import estimate
from planner.memory import OTHER_PARTS, memory_by_rank
from planner.build import build_plan
from planner.report import OTHER_LABELS, estimate_table
from planner.zoo import ZOO

A100 = load_cluster("dgx-a100-80gb")


def plan_for(model="llama2-7b", gpus=8, **kw):
    args = dict(cluster_name=A100.name, device=A100.device.name, nodes=max(1, gpus // 8),
                devices_per_node=min(8, gpus), global_batch=16,
                micro_batch=1, seq_len=2048)
    args.update(kw)
    return build_plan(ZOO[model] if isinstance(model, str) else model, **args)


def parts_of(plan, cluster=A100):
    return estimate(plan, cluster).breakdown["memory"]["other_parts"]


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(name=st.sampled_from(["tiny", "tiny-gpt", "llama2-7b", "gpt-1.7b"]), tp=st.sampled_from([1, 2, 4]),
       pp=st.sampled_from([1, 2, 4]), zero=st.sampled_from([0, 1, 2, 3]), micro_batch=st.sampled_from([1, 2]),
       schedule=st.sampled_from(["gpipe", "1f1b", "interleaved-1f1b", "zbv"]),
       recompute=st.sampled_from(["none", "selective", "full"]), sp=st.booleans(), gloo=st.booleans())
def test_the_parts_add_up_to_other_on_every_rank(name, tp, pp, zero, micro_batch, schedule, recompute, sp, gloo):
    ranks = []

    def recorded(*args, **kw):
        ranks[:] = memory_by_rank(*args, **kw)
        return ranks
    if pp == 1:
        schedule = "1f1b"
    if schedule == "zbv":
        recompute = "none"
    model = dataclasses.replace(ZOO[name], layers=8)
    plan = plan_for(model, 2 * tp * pp, tp=tp, pp=pp, zero=zero, micro_batch=micro_batch, schedule=schedule,
                    virtual_stages=2 if schedule in ("interleaved-1f1b", "zbv") else 1, recompute=recompute,
                    sequence_parallel=sp and tp > 1, seq_len=min(2048, model.seq_len))
    cluster = dataclasses.replace(A100, backend="gloo") if gloo else A100
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cost, "memory_by_rank", recorded)
        mem = estimate(plan, cluster).breakdown["memory"]
    assert set(mem["other_parts"]) == set(OTHER_PARTS) == set(OTHER_LABELS)
    assert all(v >= 0 for v in mem["other_parts"].values())
    assert sum(mem["other_parts"].values()) == pytest.approx(mem["other_bytes"], rel=1e-12, abs=1e-6)
    assert len(ranks) == pp and {r["peak_at"] for r in ranks} <= {"backward", "end of backward", "optimizer step"}
    for rank in ranks:
        assert sum(rank["other_parts"].values()) == pytest.approx(rank["other_bytes"], rel=1e-12, abs=1e-6)


def test_each_part_appears_where_the_plan_has_what_makes_it():
    # data parallelism without ZeRO: replicate's compute-dtype gradients; no pipeline, no buffers
    ddp = parts_of(plan_for(zero=0))
    assert ddp["replicated_gradients"] > 0 and ddp["pipeline_receive_buffers"] == 0 and ddp["fsdp_buffers"] == 0
    # ZeRO 3 holds the root group (embedding, head) unsharded all step and gathers blocks
    z3 = parts_of(plan_for(zero=3))
    assert z3["fsdp_buffers"] > 0 and z3["replicated_gradients"] == 0
    # a pipeline's receive buffers
    assert parts_of(plan_for(pp=2, dp=1, gpus=2))["pipeline_receive_buffers"] > 0
    # full recomputation replays a block in the backward
    full = parts_of(plan_for(recompute="full", zero=1))
    assert full["recompute_replay"] > 0 and parts_of(plan_for(recompute="none", zero=1))["recompute_replay"] == 0
    # one device, several micro-batches: a new gradient adds to the accumulated one
    assert parts_of(plan_for("tiny", gpus=1, global_batch=4, seq_len=64))["gradient_accumulation"] > 0
    # the optimizer step (torch's fused AdamW, in place) holds no part of its own
    alone = estimate(plan_for(gpus=1, global_batch=4), A100).breakdown["memory"]
    assert alone["peak_at"] == "backward" and "optimizer_temporaries" not in alone["other_parts"]


def test_the_table_lists_the_parts_that_hold_bytes():
    plan = plan_for(zero=3, recompute="full")
    est = estimate(plan, A100)
    table = estimate_table(est)
    for key, value in est.breakdown["memory"]["other_parts"].items():
        assert (OTHER_LABELS[key] in table) == (value > 0), key
