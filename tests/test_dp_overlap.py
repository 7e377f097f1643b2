"""Data-parallel communication beside the compute (planner.cost, planner.comm): the gradients'
reduction beside or after the backward, ZeRO 1's gather beside the next forward, ZeRO-2's
reduce-scatter every micro-batch."""
import dataclasses

import pytest

from planner.build import build_plan
from planner.cost import estimate
from planner.zoo import ZOO
from test_cost import A100, plan_for


def test_grad_reduce_after_backward_exposes_the_whole_sync():
    # 16 GPUs as tp=4 x pp=2 x dp=2, interleaved with v=2: with overlap off both chunks of a rank
    # reduce after its last backward, one after the other
    kw = dict(nodes=2, tp=4, pp=2, schedule="interleaved-1f1b", virtual_stages=2, global_batch=16)
    calm = dataclasses.replace(A100, overlap_slowdown=1.0)  # a reduction beside a backward slows no other rank's
    on, off = (estimate(plan_for(overlap_grad_reduce=o, **kw), calm) for o in (True, False))
    r = off.breakdown["time"]["critical_pp_rank"]
    syncs = sum(s["grad_sync_s"] for s in off.stages if s["pp_rank"] == r)
    assert syncs > 0
    assert off.breakdown["time"]["dp_comm_exposed_s"] == pytest.approx(syncs)
    assert off.step_time_s - on.step_time_s == pytest.approx(
        off.breakdown["time"]["dp_comm_exposed_s"] - on.breakdown["time"]["dp_comm_exposed_s"])
    assert off.step_time_s > on.step_time_s


def test_zero1_gathers_the_updated_parameters_beside_the_next_forward():
    # llama2-7b, tp 8 x dp 2, ZeRO 1, one micro-batch: the updated parameters gathered in the next
    # forward (FSDP2; Megatron-LM's --overlap-param-gather), what its compute leaves exposed; without
    # the overlap (DeepSpeed's ZeRO 1), or on CPU processes (gloo), all of it after the step
    gloo = dataclasses.replace(A100, backend="gloo")
    on, off, cpu, cpu_off = (estimate(plan_for(nodes=2, tp=8, zero=1, global_batch=2, overlap_param_gather=o), c)
                             for o, c in ((True, A100), (False, A100), (True, gloo), (False, gloo)))
    st = on.stages[0]
    ag = A100.with_nodes(2).collective_time("all_gather", st["params"] * st["gathered_bytes"], range(0, 16, 8))
    assert 0 < st["fwd_compute_s"] < ag and cpu.step_time_s == cpu_off.step_time_s  # part of it exposed
    exposed = off.breakdown["time"]["dp_comm_exposed_s"] - on.breakdown["time"]["dp_comm_exposed_s"]
    assert off.step_time_s - on.step_time_s == pytest.approx(st["fwd_compute_s"]) == exposed


def test_zero2_reduce_scatters_every_micro_batch_and_holds_its_gradients_sharded():
    """ZeRO-2 (P_os+g, Rajbhandari et al. 2020; DeepSpeed's stage 2) shards the gradients as they are
    produced, every micro-batch: 1/dp of ZeRO-1's gradient memory, and a backward that waits for its
    reduce-scatter where that takes longer (here: 16 DP ranks across nodes, a short backward)."""
    def est(zero, mb, nodes=2, **kw):
        plan = build_plan(ZOO["llama2-7b"], cluster_name="dgx-a100-80gb", device="a100", nodes=nodes,
                          devices_per_node=8, seq_len=128, global_batch=8 * nodes * mb, micro_batch=1, zero=zero, **kw)
        return estimate(plan, A100)
    one, two = est(1, 8), est(2, 8)
    assert two.breakdown["memory"]["gradients_bytes"] == pytest.approx(one.breakdown["memory"]["gradients_bytes"] / 16)
    assert two.step_time_s > one.step_time_s * 1.2
    assert two.breakdown["time"]["dp_comm_exposed_s"] > one.breakdown["time"]["dp_comm_exposed_s"]
    # one micro-batch: reduced as produced either way (beside the backward, ZeRO-2's buffer copies hide more)
    one, two = (est(z, 1, overlap_grad_reduce=False).step_time_s for z in (1, 2))
    assert two == pytest.approx(one) and est(2, 1).step_time_s <= est(1, 1).step_time_s
