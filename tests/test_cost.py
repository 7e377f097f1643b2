"""Cost model: memory accounting, communication tiers, and the shape of the estimate."""
import dataclasses
import pytest

from planner.cluster import load_cluster
from planner.cost import estimate
from planner.model import ZOO
from planner.build import build_plan

A100 = load_cluster("dgx-a100-80gb")


def plan_for(model="llama2-7b", nodes=1, dpn=8, **kw):
    args = dict(cluster_name=A100.name, device=A100.device.name, nodes=nodes, devices_per_node=dpn,
                global_batch=16, micro_batch=1, seq_len=2048)
    args.update(kw)
    return build_plan(ZOO[model], **args)


def test_70b_model_states_need_about_840_gb():
    # bf16 weights (2 B) + bf16 gradients (2 B) + Adam moments (8 B) = 12 B per parameter
    plan = plan_for("llama2-70b", dpn=1, global_batch=1, master_weights=False)
    mem = estimate(plan, A100).breakdown["memory"]
    states = mem["parameters_bytes"] + mem["gradients_bytes"] + mem["optimizer_bytes"]
    assert states == pytest.approx(12 * ZOO["llama2-70b"].num_parameters(), rel=1e-3)
    assert 820e9 < states < 850e9
    assert not estimate(plan, A100).fits


def test_zero_levels_shard_what_they_promise():
    dp = 8
    base = estimate(plan_for(zero=0), A100).breakdown["memory"]
    z1 = estimate(plan_for(zero=1), A100).breakdown["memory"]
    z3 = estimate(plan_for(zero=3, global_batch=8), A100).breakdown["memory"]
    assert z1["optimizer_bytes"] == pytest.approx(base["optimizer_bytes"] / dp)
    assert z1["parameters_bytes"] == base["parameters_bytes"]
    assert z3["parameters_bytes"] == pytest.approx(base["parameters_bytes"] / dp)
    assert z3["gradients_bytes"] == pytest.approx(base["gradients_bytes"] / dp)


def test_recompute_trades_memory_for_time():
    kw = dict(tp=8, global_batch=8)
    none, sel, full = (estimate(plan_for(recompute=r, **kw), A100) for r in ("none", "selective", "full"))
    acts = [e.breakdown["memory"]["activations_bytes"] for e in (none, sel, full)]
    assert acts[0] > acts[1] > acts[2]
    assert none.step_time_s < sel.step_time_s < full.step_time_s


def test_a_group_spanning_nodes_pays_the_slower_tier():
    cl = A100.with_nodes(2)
    inside = cl.collective_time("all_reduce", 1e9, [0, 1])
    across = cl.collective_time("all_reduce", 1e9, [0, 8])
    assert across > 5 * inside
    # eight ranks per node run eight rings over eight NICs
    wide = cl.collective_time("all_reduce", 1e9, list(range(16)))
    narrow = cl.collective_time("all_reduce", 1e9, [0, 8])
    assert wide < narrow


def test_placement_changes_the_prediction():
    good = plan_for(nodes=2, tp=8, pp=2, global_batch=16)
    bad = plan_for(nodes=2, tp=8, pp=2, global_batch=16, order=["tp", "dp", "pp"])  # TP across nodes
    g, b = estimate(good, A100), estimate(bad, A100)
    assert b.breakdown["time"]["tp_comm_s"] > 2 * g.breakdown["time"]["tp_comm_s"]
    assert b.step_time_s > 1.2 * g.step_time_s


def test_step_time_is_the_sum_of_its_breakdown():
    for kw in (dict(tp=2, pp=2, schedule="interleaved-1f1b", virtual_stages=2, zero=1),
               dict(pp=4, schedule="gpipe", zero=3, global_batch=8), dict(tp=8, sequence_parallel=True)):
        est = estimate(plan_for(**kw), A100)
        t = dict(est.breakdown["time"])
        t.pop("critical_pp_rank")
        assert sum(t.values()) == pytest.approx(est.step_time_s, rel=1e-9)
        assert all(v >= 0 for v in t.values())


def test_more_micro_batches_shrink_the_bubble():
    few = estimate(plan_for(pp=4, global_batch=8), A100)
    many = estimate(plan_for(pp=4, global_batch=64), A100)
    assert many.breakdown["bubble_fraction"] < few.breakdown["bubble_fraction"]


def test_estimate_json_has_the_contract_keys():
    d = estimate(plan_for(tp=2), A100).to_dict()
    for key in ("parameters", "step_time_s", "tokens_per_s", "model_tflops_per_gpu", "mfu",
                "peak_memory_bytes", "fits", "breakdown"):
        assert key in d
    for key in ("compute_s", "tp_comm_s", "dp_comm_exposed_s", "pipeline_bubble_s", "p2p_s", "optimizer_s"):
        assert key in d["breakdown"]["time"]
    for key in ("parameters_bytes", "gradients_bytes", "optimizer_bytes", "activations_bytes", "other_bytes"):
        assert key in d["breakdown"]["memory"]


def test_grad_reduce_after_backward_exposes_the_whole_sync():
    # 16 GPUs as tp=4 x pp=2 x dp=2, interleaved with v=2: with overlap off both chunks of a rank
    # reduce after its last backward, one after the other
    kw = dict(nodes=2, tp=4, pp=2, schedule="interleaved-1f1b", virtual_stages=2, global_batch=16)
    on = estimate(plan_for(**kw), A100)
    off = estimate(plan_for(overlap_grad_reduce=False, **kw), A100)
    r = off.breakdown["time"]["critical_pp_rank"]
    syncs = sum(s["grad_sync_s"] for s in off.stages if s["pp_rank"] == r)
    assert syncs > 0
    assert off.breakdown["time"]["dp_comm_exposed_s"] == pytest.approx(syncs)
    assert off.step_time_s - on.step_time_s == pytest.approx(
        off.breakdown["time"]["dp_comm_exposed_s"] - on.breakdown["time"]["dp_comm_exposed_s"])
    assert off.step_time_s > on.step_time_s


def test_devices_sharing_compute_run_the_pipeline_bubble_faster():
    # processes on shared cores: with fewer slots than processes the ranks of a pipeline that wait
    # leave their share to the others, so the bubble costs less than at the everyone-busy speed
    c = load_cluster("dgx-a100-80gb", nodes=1)
    plan = build_plan(ZOO["llama2-7b"], cluster_name=c.name, device=c.device.name, nodes=1, devices_per_node=8,
                      global_batch=16, micro_batch=1, pp=4, tp=2, schedule="1f1b")
    alone = estimate(plan, c).step_time_s
    shared = dataclasses.replace(c, compute_slots=4.0)
    est = estimate(plan, shared)
    t = est.step_time_s
    # 8 processes on 4 slots: at most 2x slower (everyone busy), and faster than that in the bubble
    assert alone < t < 2 * alone
    tb = est.breakdown["time"]
    assert tb["compute_slots"] == 4.0
    assert shared.with_nodes(2).compute_slots == 8.0  # another node brings its own cores
    assert sum(v for k, v in tb.items() if k.endswith("_s")) == pytest.approx(t)  # terms as played
    assert estimate(plan, dataclasses.replace(c, compute_slots=8.0)).step_time_s == pytest.approx(alone)
