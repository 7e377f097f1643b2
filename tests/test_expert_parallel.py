"""Expert parallelism (mesh.ep; planner.moe, planner.configs, runtime.moe): its groups, the plan's
checks, what it prices (the experts a rank holds, the all-to-alls), the search over the degrees
the runtime runs, and the plans the runtime refuses in one line."""
from __future__ import annotations

import dataclasses
import json

import pytest

from planner.build import build_plan
from planner.cost import estimate
from planner.model import ConfigError
from planner.plan import Plan
from planner.precision import model_state_bytes
from planner.zoo import ZOO
from test_moe import H100, TINY_MOE


def _mixtral_plan(**kw):
    args = dict(cluster_name=H100.name, device=H100.device.name, nodes=8, devices_per_node=8, global_batch=256,
                micro_batch=1, seq_len=4096, tp=2, pp=4, zero=1, recompute="selective", sequence_parallel=True)
    return build_plan(ZOO["mixtral-8x7b"], **{**args, **kw})


def test_expert_parallel_groups_are_ep_dp_ranks_and_their_shards_the_rest():
    from planner.mesh import Mesh
    m = Mesh(pp=2, dp=4, tp=2, ep=2)  # dp ranks of pipeline rank 0, tp 0: 0, 2, 4, 6
    assert m.expert_group(pp=0, dp=3, tp=0) == [4, 6] and m.expert_group(pp=1, dp=0, tp=1) == [9, 11]
    assert m.expert_shard_group(pp=0, dp=1, tp=0) == [2, 6]  # the ranks holding the same experts
    hsdp = Mesh(pp=1, dp=8, tp=1, ep=2, dp_replicate=2)  # shard groups 0-3 and 4-7
    assert hsdp.expert_shard_group(dp=5) == [5, 7] and hsdp.expert_group(dp=5) == [4, 5]
    assert Mesh(pp=1, dp=4, tp=1).expert_shard_group(dp=2) == [0, 1, 2, 3]  # without EP: the shard group


def test_expert_parallelism_is_checked_and_left_out_of_plan_files_at_one(tmp_path):
    for kw, says in ((dict(ep=3), "does not divide model.moe.experts=8"),
                     (dict(ep=8, dp_replicate=2), r"must divide the data-parallel shard group \(dp / dp_replicate = 4"),
                     (dict(ep=0), "must be a positive integer")):
        with pytest.raises(ConfigError, match=rf"mesh\.ep: .*{says}"):
            _mixtral_plan(**kw)
    with pytest.raises(ConfigError, match="mesh.ep: 2: expert parallelism needs a mixture-of-experts model"):
        build_plan(ZOO["llama3-8b"], cluster_name=H100.name, device=H100.device.name, nodes=1, devices_per_node=8,
                   global_batch=16, micro_batch=1, ep=2)
    assert "ep" not in _mixtral_plan().to_dict()["mesh"]
    plan = _mixtral_plan(ep=4)
    plan.write(tmp_path / "a.json")
    assert Plan.read(tmp_path / "a.json").mesh.ep == 4


def test_expert_parallelism_prices_its_all_to_alls_and_spreads_the_experts():
    """Each rank holds experts / ep of them: under ZeRO 1 its parameters and gradients shrink,
    under ZeRO 3 its model states stay what they were (experts / ep over dp / ep ranks, FSDP2's
    float32 shard and no 16-bit copy even where dp / ep is 1); every block exchanges its token
    counts, sends each token once to each rank holding any of its 2 experts (with that rank's 2
    weights and choices) and gets their weighted sum back, twice forward and twice backward."""
    m = ZOO["mixtral-8x7b"]
    experts = 3 * m.hidden * m.ffn_hidden * m.moe.experts * m.layers / 2 / 4  # a rank's: tp 2, pp 4
    pb, gb, _ = model_state_bytes(_mixtral_plan().training, 8)
    kinds = ("parameters_bytes", "gradients_bytes", "optimizer_bytes")
    for zero in (1, 3):
        flat, spread = ([e.breakdown["memory"][k] for k in kinds]
                        for e in (estimate(_mixtral_plan(zero=zero, ep=ep), H100) for ep in (1, 4)))
        if zero == 1:  # parameters and gradients held whole (ZeRO 1): 3 of 4 of the experts' gone; the
            # optimizer states as before: experts / 4 over dp / 4 ranks
            want = [experts * 3 / 4 * pb, experts * 3 / 4 * gb, 0.0]
            assert [a - b for a, b in zip(flat, spread)] == pytest.approx(want, abs=1.0)
        else:
            assert spread == pytest.approx(flat, rel=1e-9)
            alone = [estimate(_mixtral_plan(zero=3, ep=8), H100).breakdown["memory"][k] for k in kinds]
            assert alone == pytest.approx(flat, rel=1e-9)  # the 8 dp ranks one EP group
    assert "ep_comm_s" not in estimate(_mixtral_plan(), H100).breakdown["time"]
    plan = _mixtral_plan(ep=4, recompute="none")
    t = plan.training
    group = plan.mesh.expert_group(pp=0, dp=0, tp=0)
    # a token's 2 of 8 experts on 4 ranks of 2 each: both on one rank with probability 4 / C(8, 2)
    rows = t.seq_len * (1 * 4 / 28 + 2 * 24 / 28)
    a2a = H100.shaped_as(8, 8).collective_time
    dispatch, combine = (a2a("all_to_all", 2 * rows * w, group) for w in (m.hidden + 4, m.hidden))
    counts = a2a("all_to_all", 8 * 4, group)  # int64 a rank
    blocks = [st.end - st.start - (st.start == 0) - (st.end == m.num_layers_total) for st in plan.pipeline.stages]
    est = estimate(plan, H100)
    r = est.breakdown["time"]["critical_pp_rank"]
    want = (2 * dispatch + 2 * combine + counts) * blocks[r] * plan.pipeline.micro_batches
    assert est.breakdown["time"]["ep_comm_s"] == pytest.approx(want)
    assert 0 < counts < 0.2 * combine  # a latency: 26 us against a combine's 152


def test_the_search_spreads_experts_only_where_the_runtime_can():
    from planner.configs import ep_degrees
    m = ZOO["mixtral-8x7b"]
    assert ep_degrees(m, 8, (0, 1, 2, 3)) == [1, 2, 4, 8]  # dp 8 (or dp 8 x cp 2: dp coordinates), 8 experts
    assert ep_degrees(m, 8, (None,)) == [1, 2, 4, 8]  # ZeRO chosen per stage: among 1-3 where spread
    assert ep_degrees(m, 8, (0,)) == [1] and ep_degrees(m, 6, (1,)) == [1, 2]
    assert ep_degrees(m, 4, (3,)) == [1, 2, 4]  # HSDP: the 4 ranks of a shard group
    assert ep_degrees(ZOO["llama3-8b"], 8, (1,)) == [1]


def test_the_search_spreads_experts_where_that_is_faster(capsys):
    """Mixtral 8x7B on 8 DGX H100 nodes: the search chooses the expert-parallel degree with the
    rest of the plan (planner.configs); the best spreads the experts over the 8 dp ranks of a node."""
    from planner.cli import main
    argv = ["search", "--cluster", "dgx-h100-80gb", "--gpus", "64", "--global-batch", "256", "--seq-len", "4096",
            "--json", "--top", "3", "--model"]
    assert main(argv + ["mixtral-8x7b"]) == 0
    spread = json.loads(capsys.readouterr().out)
    assert main(argv + ["mixtral-8x7b", "--ep", "1"]) == 0
    flat = json.loads(capsys.readouterr().out)
    assert spread["step_time_s"] < flat["step_time_s"] and spread["breakdown"]["time"]["ep_comm_s"] > 0
    assert "ep_comm_s" not in flat["breakdown"]["time"] and all(a["degrees"]["ep"] == 1 for a in flat["alternatives"])
    assert main(argv + ["llama3-8b", "--ep", "2"]) == 2
    assert "--ep: expert parallelism is for mixture-of-experts models" in capsys.readouterr().err


def test_a_model_that_fits_only_with_its_experts_spread_is_found(capsys):
    """Mixtral 8x7B on one DGX H100 node: no plan fits with every expert on every rank (ZeRO 3
    gathers a block's 8 experts at once); spread over the node's 8 ranks (one expert each) one
    does. The degree is a dimension of the search, not a pass over the plans it found."""
    from planner.cli import main
    from planner.search import SearchSpace, search
    node = H100.with_nodes(1)
    res = search(ZOO["mixtral-8x7b"], node, global_batch=16, seq_len=4096)
    assert res.best is not None and res.best.plan.mesh.ep > 1 and res.best.estimate.fits
    assert search(ZOO["mixtral-8x7b"], node, global_batch=16, seq_len=4096, space=SearchSpace(ep=(1,))).best is None
    argv = ["search", "--model", "mixtral-8x7b", "--cluster", "dgx-h100-80gb", "--gpus", "8", "--global-batch", "16",
            "--seq-len", "4096", "--ep", "8", "--zero", "0"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--ep: 8 spreads experts under ZeRO 1-3" in err and "--zero 0 leaves out" in err


def test_expert_parallel_plans_the_runtime_cannot_run_are_one_line(tmp_path, capsys, monkeypatch):
    from runtime.train import main as train_main
    from torchrun_helpers import write_plan
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert train_main(["--plan", str(write_plan(tmp_path, "ep2", TINY_MOE, world=2, ep=2, zero=0))]) == 2
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("trident: error:")]
    assert len(lines) == 1 and "mesh.ep: 2: the runtime spreads experts under ZeRO 1-3" in lines[0], lines


def test_a_token_goes_once_to_each_rank_holding_its_experts():
    """planner.moe.ranks_per_token, the ranks a token's k experts sit on (experts / ep consecutive
    ones a rank), against tokens routed to k distinct experts drawn uniformly: within 1% of 20,000
    tokens' count, k where a rank holds one expert, 1 with one rank."""
    from planner.moe import MoESpec, ranks_per_token
    import torch
    gen = torch.Generator().manual_seed(0)
    for n, k, ep in ((8, 2, 8), (8, 2, 4), (128, 8, 8), (64, 6, 16), (4, 2, 2), (16, 4, 1)):
        m = dataclasses.replace(ZOO["mixtral-8x7b"], moe=MoESpec(n, k))
        chosen = torch.rand(20000, n, generator=gen).topk(k, dim=1).indices
        hit = torch.zeros(20000, ep, dtype=torch.bool).scatter(1, chosen // (n // ep), True)
        assert ranks_per_token(m, ep) == pytest.approx(hit.sum(1).double().mean().item(), rel=0.01), (n, k, ep)
    assert ranks_per_token(ZOO["mixtral-8x7b"], 8) == pytest.approx(2.0) and ranks_per_token(ZOO["mixtral-8x7b"], 1) == 1.0
    assert ranks_per_token(ZOO["qwen3-30b-a3b"], 8) == pytest.approx(5.34, abs=0.005)


def test_the_busiest_expert_paces_its_ep_group(tmp_path):
    """training.moe_load_factor (the busiest expert's rows over the mean): under expert parallelism
    the rank holding it computes, keeps and exchanges that many more rows (its other experts at the
    mean, no rank more than min(k, experts / ep) rows a token); without it nothing changes."""
    from planner.layers import layer_cost
    from planner.moe import expert_load
    m = ZOO["mixtral-8x7b"]
    for ep, lam, extra in ((8, 1.5, 0.5), (4, 1.5, 0.25), (8, 4.0, 3.0), (2, 4.0, 0.75), (1, 4.0, 0.0)):
        assert expert_load(_mixtral_plan(ep=ep, moe_load_factor=lam), "block") == pytest.approx(extra)
    for rec in ("none", "full"):
        even, busy = (_mixtral_plan(ep=4, recompute=rec, moe_load_factor=lam) for lam in (1.0, 1.5))
        a, b = (layer_cost(p, H100, 1, p.pipeline.stages[0], [0, 1]) for p in (even, busy))
        g = m.block_gemms(1, 4096, 2)[2:4]  # the experts' products on a TP rank
        assert b.fwd_compute_s - a.fwd_compute_s > 0.25 * sum(2.0 * c * M * N * K for c, M, N, K in g) / 989e12
        counts = H100.collective_time("all_to_all", 8 * 4, even.mesh.expert_group(pp=0, dp=0, tp=0))
        assert b.fwd_ep_s - counts == pytest.approx(1.25 * (a.fwd_ep_s - counts))  # dispatch and combine
        kept = 0.25 * 4096 * 2 * (2 * m.hidden + 4 * 2 * m.ffn_hidden / 2)  # rows read, SwiGLU's four, bf16
        got = (b.replay_bytes - a.replay_bytes) if rec == "full" else (b.activation_bytes - a.activation_bytes)
        assert got == pytest.approx(kept) and (rec != "full" or b.activation_bytes == a.activation_bytes)
    flat = [estimate(_mixtral_plan(moe_load_factor=lam), H100) for lam in (1.0, 3.0)]  # ep 1
    assert flat[0].step_time_s == flat[1].step_time_s and flat[0].peak_memory_bytes == flat[1].peak_memory_bytes
    plan = _mixtral_plan(ep=4, moe_load_factor=1.25)
    plan.write(tmp_path / "p.json")
    assert Plan.read(tmp_path / "p.json").training.moe_load_factor == 1.25
    assert "moe_load_factor" not in _mixtral_plan(ep=4).to_dict()["training"]
    for kw, says in ((dict(moe_load_factor=0.9), "must be a number of at least 1"),
                     (dict(moe_load_factor=4.5), r"more than experts / experts_per_token \(4\)")):
        with pytest.raises(ConfigError, match=rf"training\.moe_load_factor: .*{says}"):
            _mixtral_plan(**kw)
    with pytest.raises(ConfigError, match=r"training\.moe_load_factor: is for mixture-of-experts models"):
        build_plan(ZOO["llama3-8b"], cluster_name=H100.name, device=H100.device.name, nodes=1, devices_per_node=8,
                   global_batch=8, micro_batch=1, moe_load_factor=1.2)


def test_the_search_spreads_experts_less_the_busier_its_busiest():
    """The search weighs the busiest expert's rank: Mixtral 8x7B at tp 2 x pp 4 x dp 8 (ZeRO 1,
    selective recomputation, 1F1B) spreads its experts over 4 ranks where routing is balanced or
    1.2x, not at all at 1.5x or 2x (at 1.5x: 3.75 s without, 3.87 s over 2 ranks, their second
    expert at the mean, 3.88 s over 4); where it spreads them the plan is the fastest of the degrees
    as the estimate prices them."""
    from planner.search import SearchSpace, search
    space = SearchSpace(tp=(2,), pp=(4,), micro_batch=(1,), schedules=("1f1b",), zero=(1,), zero_per_stage=False,
                        recompute=("selective",), recompute_granularity="plan", sequence_parallel=(True,),
                        orders=(("pp", "dp", "tp"),))
    picked = {}
    for lam in (1.0, 1.2, 1.5, 2.0):
        best = search(ZOO["mixtral-8x7b"], H100.with_nodes(8), global_batch=256, seq_len=4096, space=space,
                      moe_load_factor=lam).best
        picked[lam] = best.plan.mesh.ep
        for ep in (1, 2, 4, 8):  # its partition with every other degree
            p = dataclasses.replace(best.plan, mesh=dataclasses.replace(best.plan.mesh, ep=ep)).validate()
            est = estimate(p, H100.with_nodes(8))
            assert not est.fits or est.step_time_s >= best.estimate.step_time_s * (1 - 1e-12)
    assert picked == {1.0: 4, 1.2: 4, 1.5: 1, 2.0: 1}
