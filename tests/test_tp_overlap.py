"""training.tp_comm_overlap (planner.comm.overlapped_sp_comm): a dense block's sequence-parallel
collectives beside its linear layers' GEMMs, each hiding ASYNC_TP_HIDDEN of the time they share."""
import pytest

from planner.build import build_plan
from planner.cluster import load_cluster
from planner.comm import ASYNC_TP_HIDDEN
from planner.cost import estimate
from planner.layers import gemm_time, layer_cost
from planner.zoo import ZOO

H100 = load_cluster("dgx-h100-80gb")


def plan_for(**kw):
    args = dict(cluster_name=H100.name, device=H100.device.name, nodes=1, devices_per_node=8, tp=8, dp=1,
                global_batch=8, micro_batch=1, seq_len=8192, sequence_parallel=True, recompute="none")
    args.update(kw)
    return build_plan(ZOO["llama3-70b"], **args)


def block(plan):
    return layer_cost(plan, H100, 1, plan.pipeline.stages[0], plan.mesh.group("tp", pp=0, dp=0))


@pytest.mark.parametrize("kept", ["shard", "gathered"])
def test_each_collective_hides_behind_its_linear(kept):
    """Closed form for a Llama 3 70B block at TP 8: forward, the two all-gathers beside QKV and the
    MLP's gate and up, the two reduce-scatters beside the output and down projections; backward the
    reverse, and (keeping shards) the two inputs' regathers beside QKV's and gate-and-up's."""
    m, T, tp = ZOO["llama3-70b"], 8192, 8
    plain, over = (block(plan_for(tp_comm_overlap=o, sp_saved_inputs=kept)) for o in (False, True))
    act = 2 * T * m.hidden
    ranks = list(range(tp))
    ag, rs = (H100.collective_time(op, act, ranks) for op in ("all_gather", "reduce_scatter"))
    rate = lambda M, N, K: H100.device.gemm_flops_per_s("bf16", M, N, K)  # noqa: E731
    qkv, proj, up, down = (gemm_time(*g, 2, rate, H100.device.memory_bytes_per_s)
                           for g in m.block_gemms(1, T, tp)[:4])
    hide = lambda c, g: c - ASYNC_TP_HIDDEN * min(c, g)  # noqa: E731
    again = 1 if kept == "shard" else 0
    assert plain.fwd_tp_s == pytest.approx(2 * (ag + rs))
    assert plain.bwd_tp_s == pytest.approx(2 * (ag + rs) + 2 * again * ag)
    assert over.fwd_tp_s == pytest.approx(hide(ag, qkv) + hide(rs, proj) + hide(ag, up) + hide(rs, down))
    assert over.bwd_tp_s == pytest.approx(hide(rs, qkv) + hide(ag, proj) + hide(rs, up) + hide(ag, down)
                                          + again * (hide(ag, qkv) + hide(ag, up)))
    assert over.fwd_tp_s < plain.fwd_tp_s and (over.fwd_compute_s, over.bwd_compute_s) == (plain.fwd_compute_s,
                                                                                          plain.bwd_compute_s)


def test_it_moves_only_sequence_parallel_dense_blocks():
    for kw in (dict(sequence_parallel=False), dict(tp=1, dp=8)):
        plain, over = (estimate(plan_for(tp_comm_overlap=o, **kw), H100).step_time_s for o in (False, True))
        assert over == plain
    plain, over = (estimate(plan_for(tp_comm_overlap=o), H100) for o in (False, True))
    assert over.breakdown["time"]["tp_comm_s"] < 0.5 * plain.breakdown["time"]["tp_comm_s"]
