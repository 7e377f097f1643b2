"""The search's configuration bounds are lower bounds: never above the LB of any assignment the
inner problem can choose (enumerated exhaustively on small cases), and infinite only where no
assignment fits. The slope of a collective's time never overstates it."""
import dataclasses
import itertools
import json
import math

import pytest

from planner.cluster import PROFILE_DIR, cluster_from_dict, load_cluster
from planner.partition import Inner
from planner.plan import Training
from planner.configs import configs as _configs
from planner.search import Ctx, SearchSpace
from test_search import GiB, shrunk

SHAPES = [(2, 1, 2), (8, 1, 8), (16, 2, 8), (64, 8, 8), (24, 8, 3), (4, 4, 1)]
SIZES = [1.0, 1e3, 1e5, 3e6, 1e8, 4e9, 1e12]


def _check_slopes(cluster):
    for op, shape, x in itertools.product(("all_gather", "all_reduce", "reduce_scatter", "send_recv", "all_to_all"),
                                          SHAPES, SIZES):
        n, nodes, _ = shape
        if nodes > 1 and not cluster.nodes:
            continue
        slope = cluster.seconds_per_byte(op, shape)
        assert slope >= 0
        assert cluster.shaped_collective_time(op, x, shape) >= slope * x * (1 - 1e-12), (op, shape, x)


def test_collective_slope_is_a_lower_bound_of_its_time():
    for name in sorted(p.stem for p in PROFILE_DIR.glob("*.json")):  # every shipped profile
        cluster = load_cluster(name, nodes=8)
        _check_slopes(cluster)
        # an alpha-beta line's slope is its beta exactly
        ab = cluster.collectives["send_recv"]["inter_node"]
        assert cluster.seconds_per_byte("send_recv", (2, 2, 1)) == pytest.approx(1 / ab.bus_bandwidth_bytes_per_s)
    # a measured profile: per-size segments, and the shipped busbw curve
    d = json.loads((PROFILE_DIR / "dgx-a100-80gb.json").read_text())
    d["collectives"]["all_gather"]["intra_node"]["by_group_size"] = {"8": {
        "alpha_s": 1e-5, "bus_bandwidth_bytes_per_s": 2e11,
        "segments": [{"up_to_bytes": 1e6, "alpha_s": 2e-5, "bus_bandwidth_bytes_per_s": 5e10},
                     {"up_to_bytes": None, "alpha_s": 1e-5, "bus_bandwidth_bytes_per_s": 2.4e11}]}}
    measured = cluster_from_dict(d).with_nodes(8)
    _check_slopes(measured)
    assert measured.seconds_per_byte("all_gather", (8, 1, 8)) == pytest.approx(7 / 8 / 2.4e11)
    # a latency below zero (profiles refuse one; the slope does not rely on that) gives no slope
    tiers = dict(measured.collectives["reduce_scatter"])
    tiers["intra_node"] = dataclasses.replace(tiers["intra_node"], alpha_s=-3e-5, by_size=())
    measured.collectives["reduce_scatter"] = tiers
    assert measured.seconds_per_byte("reduce_scatter", (8, 1, 8)) == 0.0


CASES = [  # (layers, gpus, global batch, memory limit GiB, space): some configurations fit, some not
    (4, 8, 8, 1.2, SearchSpace()),
    (4, 8, 8, 1.6, SearchSpace()),
    (6, 8, 16, 2.0, SearchSpace(schedules=("zbv", "interleaved-1f1b"))),
    (5, 4, 8, 1.8, SearchSpace(schedules=("zbv", "1f1b"), zero=(0, 3))),
    (6, 4, 8, 1.5, SearchSpace(schedules=("zbv",))),
    (4, 8, 16, 1.6, SearchSpace(dp_replicate=(1, 2, 4), zero=(0, 2, 3))),  # HSDP's configurations too
]


def _case_ctx(layers, gpus, gbs, limit, space) -> Ctx:
    """The search's context of a CASES row: a shrunk model on one node of `gpus` A100s."""
    train = Training(global_batch=gbs, micro_batch=1, seq_len=1024, dtype="bf16", master_weights=True)
    return Ctx(shrunk(layers), load_cluster("dgx-a100-80gb").shaped_as(1, gpus), train, limit * GiB, space)


@pytest.mark.parametrize("layers,gpus,gbs,limit,space", CASES)
def test_configuration_bounds_are_below_every_assignment(layers, gpus, gbs, limit, space):
    """Over every configuration whose inner problem is enumerated exhaustively: the balance and
    config bounds never exceed the best assignment's LB, so the search can skip a configuration by
    them without losing a plan, and infinite bounds come only with nothing that fits."""
    fit, none = _bounds_below_best(_case_ctx(layers, gpus, gbs, limit, space), gbs)
    assert fit >= 3 and none >= 1  # both sides are tested


def _bounds_below_best(ctx, gbs) -> tuple[int, int]:
    """test_configuration_bounds_are_below_every_assignment's check over every configuration of
    `ctx`: (configurations where some assignment fits, where none does)."""
    fit = none = 0
    for cfg in _configs(ctx, gbs):
        inner = Inner(ctx, cfg).setup()
        cands = inner.candidates(math.inf)
        if not inner.exhaustive:
            continue
        best = min((lb for lb, _ in cands), default=math.inf)
        bound = Inner(ctx, cfg).balance_bound()
        lb, _ = Inner(ctx, cfg).config_bound()
        if math.isinf(best):
            none += 1
            continue
        fit += 1
        assert bound <= best * (1 + 1e-9), (cfg, bound, best)
        assert lb <= best * (1 + 1e-9), (cfg, lb, best)
    return fit, none


@pytest.mark.parametrize("limit", [1.45, 1.7])
def test_expert_parallel_configurations_are_bounded_below_too(limit):
    """A mixture-of-experts model on two nodes, every expert-parallel degree: its experts reduce and
    gather over their own group, cheaper per byte than the shard group where smaller; the bounds
    price a parameter at the cheaper of the two and stay below every assignment and estimate."""
    from planner.moe import MoESpec
    model = dataclasses.replace(shrunk(4, 1024), name="shrunk-moe", moe=MoESpec(4, 2))
    train = Training(global_batch=16, micro_batch=1, seq_len=1024, dtype="bf16", master_weights=True)
    space = SearchSpace(tp=(2, 4), micro_batch=(1,), schedules=("1f1b", "zbv"), zero=(1, 3), recompute=("none", "full"))
    ctx = Ctx(model, load_cluster("dgx-a100-80gb").with_nodes(2), train, limit * GiB, space)
    assert any(c.ep > 1 for c in _configs(ctx, 16))
    fit, none = _bounds_below_best(ctx, 16)
    assert fit >= 3 and none >= 1
    assert assert_bounds_below_estimates(ctx, 16, 1024, per_config=2) >= 20



@pytest.mark.parametrize("layers", [5, 9])
def test_the_balance_bound_counts_whole_blocks_a_rank(layers):
    """5 (9) blocks on 4 pipeline ranks: some rank runs 2 (3) of them, and the bound knows it (a
    rank's share of fractional blocks gave 0.69 (0.79) of the best split's bound)."""
    ctx = _case_ctx(layers, 4, 64, 80.0, SearchSpace(schedules=("1f1b",), zero=(0,), recompute=("none",)))
    cfg = next(c for c in _configs(ctx, 64) if c.pp == 4 and c.micro_batches == 64)
    inner = Inner(ctx, cfg).setup()
    best = min(lb for lb, _ in inner.candidates(math.inf))
    assert inner.exhaustive and 0.95 * best <= Inner(ctx, cfg).balance_bound() <= best * (1 + 1e-9)


def assert_bounds_below_estimates(ctx, gbs, seq, per_config=6, model_profile=None, **training) -> int:
    """Over every configuration: each of the first `per_config` candidates' LB
    (planner.stages.StageCosts.evaluate) is at most its plan's estimate (priced as the search prices,
    without a profile's extras); the number checked."""
    from planner.build import build_plan
    from planner.cost import estimate
    model, cluster = ctx.model, ctx.cluster
    checked = 0
    for cfg in _configs(ctx, gbs):
        def build(cfg, stages):
            return build_plan(model, cluster_name=cluster.name, device=cluster.device.name, nodes=cluster.nodes,
                              devices_per_node=cluster.devices_per_node, global_batch=gbs, micro_batch=cfg.micro_batch,
                              seq_len=seq, tp=cfg.tp, pp=cfg.pp, dp=cfg.dp, cp=cfg.cp, schedule=cfg.schedule,
                              virtual_stages=cfg.v, order=list(cfg.order), stages=stages,
                              dp_replicate=cfg.dp_replicate, ep=cfg.ep, **training)
        inner = Inner(ctx, cfg).setup()
        for lb, assign in inner.candidates(math.inf)[:per_config]:
            est = estimate(inner.to_plan(assign, build), cluster, model_profile=model_profile, profile_extras=False)
            assert lb <= est.step_time_s * (1 + 1e-9), (cfg, [k for k, _, _ in assign], lb, est.step_time_s)
            checked += 1
    return checked


def test_an_assignments_bound_is_below_its_estimate():
    """Every assignment's LB against its plan's estimate, on a small case whose point-to-point sends
    are slow enough to matter: with blocking sends a rank's own sends are part of its serial work
    and of the chain its last backward flows back along, and the bound counts each once (session
    40: the last send back was counted twice, and a measured profile made the search miss the
    fastest plan by 0.3%)."""
    d = json.loads((PROFILE_DIR / "dgx-a100-80gb.json").read_text())
    d["collectives"]["send_recv"]["intra_node"] = {"alpha_s": 2e-4, "bus_bandwidth_bytes_per_s": 2e9}
    cluster = cluster_from_dict(d).shaped_as(1, 4)
    space = SearchSpace(zero=(0, 3), recompute=("none", "full"), dp_replicate=(1, 2))
    train = Training(global_batch=8, micro_batch=1, seq_len=1024, dtype="bf16", master_weights=True)
    assert assert_bounds_below_estimates(Ctx(shrunk(4), cluster, train, 80 * GiB, space), 8, 1024) >= 300


def test_a_gradient_reduction_beside_the_backward_is_bounded_by_what_the_backward_cannot_hide():
    """On GPUs a stage's gradient reduction runs layer by layer beside its last backward
    (planner.comm.sync_parts); each option's bound counts what its backward cannot hide of the last
    part, the last two and all of them. Collectives slow enough that the reduction outlasts the
    backward: every assignment's LB is at most its estimate, and a one-stage plan's, which has no
    order among its blocks to play, is its estimate but for a latency."""
    d = json.loads((PROFILE_DIR / "dgx-a100-80gb.json").read_text())
    for op in ("all_reduce", "reduce_scatter", "all_gather"):
        d["collectives"][op]["intra_node"] = {"alpha_s": 3e-5, "bus_bandwidth_bytes_per_s": 2e9}
    cluster = cluster_from_dict(d).shaped_as(1, 4)
    space = SearchSpace(zero=(0, 1, 2, 3), recompute=("none", "full"), schedules=("1f1b", "zbv"), dp_replicate=(1, 2))
    train = Training(global_batch=8, micro_batch=1, seq_len=1024, dtype="bf16", master_weights=True)
    ctx = Ctx(shrunk(4), cluster, train, 80 * GiB, space)
    assert assert_bounds_below_estimates(ctx, 8, 1024, per_config=8) >= 250
    from planner.build import build_plan
    from planner.cost import estimate
    one = [c for c in _configs(ctx, 8) if c.pp == 1 and c.dp == 4 and c.micro_batches == 2]
    for cfg in one:
        inner = Inner(ctx, cfg).setup()
        lb, assign = min(inner.candidates(math.inf), key=lambda x: x[0])
        plan = inner.to_plan(assign, lambda c, st: build_plan(
            ctx.model, cluster_name=cluster.name, device=cluster.device.name, nodes=1, devices_per_node=4,
            global_batch=8, micro_batch=c.micro_batch, seq_len=1024, tp=c.tp, pp=1, dp=c.dp, stages=st,
            dp_replicate=c.dp_replicate))
        est = estimate(plan, cluster, profile_extras=False)
        assert est.breakdown["time"]["dp_comm_exposed_s"] > 0.1 * est.step_time_s  # the reduction shows
        # but for the latency of the gradient norm's scalar all-reduce, which bounds leave out
        assert 0 <= est.step_time_s - lb <= 3e-5 + 1e-8, cfg
    assert len(one) >= 2


@pytest.mark.parametrize("fast,slowdown", [(True, 1.189), (False, 1.4)])
def test_bounds_stay_below_estimates_where_collectives_slow_the_compute_beside_them(fast, slowdown):
    """A collective beside compute slows it (planner.comm.overlap_steal): the ZeRO-3 gathers and
    reduce-scatters beside a forward or backward, ZeRO 1's gather beside the next forward, the
    gradient reduction beside the last backward and, through it, the stages waiting for that
    backward. Every assignment's LB stays at most its estimate, with the shipped DGX A100 profile
    (its reductions hide behind the backward) and with 2 GB/s collectives that outlast it."""
    d = json.loads((PROFILE_DIR / "dgx-a100-80gb.json").read_text())
    d["overlap_slowdown"] = slowdown
    if not fast:
        for op in ("all_reduce", "reduce_scatter", "all_gather"):
            d["collectives"][op]["intra_node"] = {"alpha_s": 3e-5, "bus_bandwidth_bytes_per_s": 2e9}
    cluster = cluster_from_dict(d).shaped_as(1, 4)
    space = SearchSpace(zero=(0, 1, 3), recompute=("none", "full"), schedules=("1f1b", "interleaved-1f1b", "zbv"))
    train = Training(global_batch=8, micro_batch=1, seq_len=1024, dtype="bf16", master_weights=True)
    assert assert_bounds_below_estimates(Ctx(shrunk(4), cluster, train, 80 * GiB, space), 8, 1024, per_config=8) >= 200


@pytest.mark.parametrize("layers,gpus,gbs,limit,space", [CASES[1], CASES[2]])
def test_assignments_bounded_together_get_each_its_own_bound(layers, gpus, gbs, limit, space):
    """The search bounds assignments in batches (StageCosts.evaluate_many): each one's LB, or None
    where it does not fit, is the one it gets alone, whatever it is batched with."""
    ctx = _case_ctx(layers, gpus, gbs, limit, space)
    fit = unfit = 0
    for cfg in _configs(ctx, gbs):
        inner = Inner(ctx, cfg).setup()
        opts = inner.options(inner.L)
        per_stage = [[(k, mn, int(i)) for k, (mn, ok) in opts[s].items() for i in ok] for s in range(inner.S)]
        batch = [list(a) for a in itertools.islice(itertools.product(*per_stage), 20_000)
                 if sum(k for k, _, _ in a) == inner.L][:300]
        alone = [inner.evaluate(a) for a in batch]
        for together in (inner.evaluate_many(batch), inner.evaluate_many(batch[::-1])[::-1]):
            assert [x is None for x in together] == [x is None for x in alone], cfg
            assert [x for x in together if x is not None] == pytest.approx([x for x in alone if x is not None],
                                                                            rel=1e-12), cfg
        fit += sum(x is not None for x in alone)
        unfit += sum(x is None for x in alone)
    assert fit >= 100 and unfit >= 100  # both kinds are batched


@pytest.mark.parametrize("schedule,pp,v,blocks", [("zbv", 2, 2, 7), ("zbv", 3, 2, 8), ("interleaved-1f1b", 2, 3, 8)])
def test_the_rank_split_balances_ranks_as_well_as_any_split(schedule, pp, v, blocks):
    """planner.rank_split (several chunks a rank) against every split of a few blocks over the
    stages: its busiest rank (a rank's cost: its chunks' summed costs) costs the least any split
    achieves under the same cap on a stage, and it places every block. Costs grow with the blocks,
    each stage's at its own rate, and the first and last stages hold the embedding and the head."""
    import numpy as np
    from planner.plan import stage_rank
    from planner.rank_split import rank_split
    rng = np.random.default_rng(pp * 10 + blocks)
    S = pp * v
    owner = [stage_rank(schedule, pp, s) for s in range(S)]
    stages_of = [[s for s in range(S) if owner[s] == r] for r in range(pp)]
    for trial in range(20):
        rate = rng.uniform(0.8, 1.2, S)
        cost = np.cumsum(np.tile(rate[:, None], blocks + 1), axis=1) - rate[:, None] + rng.uniform(0, 0.3, S)[:, None]
        cost[1:-1, 0] = np.inf  # a middle stage holds a block at least
        cost[:, blocks - 1:] = np.inf if trial % 2 else cost[:, blocks - 1:]  # and at most blocks - 2, now and then
        for cap in (np.inf, np.sort(cost[np.isfinite(cost)])[len(cost) * 2]):
            capped = np.where(cost <= cap, cost, np.inf)
            best = min((max(sum(capped[s, k[s]] for s in st) for st in stages_of)
                        for k in itertools.product(range(blocks + 1), repeat=S) if sum(k) == blocks), default=np.inf)
            sizes = rank_split(cost, blocks, stages_of, cap)
            if not np.isfinite(best):
                assert sizes is None
                continue
            assert sum(sizes) == blocks and all(np.isfinite(capped[s, k]) for s, k in enumerate(sizes))
            busiest = max(sum(capped[s, sizes[s]] for s in st) for st in stages_of)
            assert busiest == pytest.approx(best, rel=1e-12), (trial, cap, sizes)


def test_plans_recomputing_more_than_one_that_fits_are_not_priced_and_the_picks_stay(monkeypatch):
    """Of a configuration's assignments, one with the same stages, block counts and ZeRO levels
    as a priced one that fits and at least its recomputation in every block
    (planner.partition.recomputes_more) is not priced: the same plans come out, fewer priced (on a
    stage whose communication paces it every option's bound is the same)."""
    import planner.search as S
    from planner.search import search
    from planner.zoo import ZOO
    model, cluster = ZOO["llama2-7b"], load_cluster("dgx-a100-80gb").shaped_as(1, 8)
    kw = dict(global_batch=16, seq_len=2048, memory_limit_bytes=36 * GiB, top=5)
    skipped = search(model, cluster, **kw)
    monkeypatch.setattr(S, "recomputes_more", lambda a, b: False)
    every = search(model, cluster, **kw)
    assert [f.estimate.step_time_s for f in skipped.results] == [f.estimate.step_time_s for f in every.results]
    assert [f.config for f in skipped.results] == [f.config for f in every.results]
    assert skipped.priced < every.priced


def test_zero_2_and_3_with_several_micro_batches_are_bounded_below_their_played_last_backward():
    """Under ZeRO 2 and 3 every micro-batch's backward reduce-scatters beside it, and the stage's
    last backward plays its gathers and reduce-scatters on one communicator (planner.cost), ending
    sooner than an earlier backward where its reduction runs on past it. On 8 GPUs whose gathers
    and reduce-scatters are slow and whose TP all-reduces are fast, pipelines up to 4 ranks of 2 to
    8 micro-batches: the configuration bounds stay below every assignment, and every assignment's
    LB below its estimate (counting each stage's last backward as an earlier one in the chain back
    to rank 0 it was not). The expert-parallel case above caught the configuration bounds counting
    the TP time and FSDP2 copies that last backward runs beside its communication."""
    check_bounds_on_slow_zero_communication((0, 2, 3))


def check_bounds_on_slow_zero_communication(zeros, **training):
    """On 8 GPUs whose gathers and reduce-scatters are slow and whose all-reduces are fast, pipelines
    of 2 to 8 micro-batches at these ZeRO levels (`training`: Training fields): the configuration
    bounds below every assignment, every assignment's LB below its estimate."""
    d = json.loads((PROFILE_DIR / "dgx-a100-80gb.json").read_text())
    for op, bw in (("all_reduce", 2e11), ("reduce_scatter", 1e9), ("all_gather", 1e9)):
        d["collectives"][op]["intra_node"] = {"alpha_s": 3e-5, "bus_bandwidth_bytes_per_s": bw}
    cluster = cluster_from_dict(d).shaped_as(1, 8)
    space = SearchSpace(zero=zeros, recompute=("none", "full"), schedules=("1f1b",))
    checked = 0
    for gbs in (8, 16):
        train = Training(global_batch=gbs, micro_batch=1, seq_len=1024, dtype="bf16", master_weights=True, **training)
        ctx = Ctx(shrunk(4), cluster, train, 80 * GiB, space)
        fit, _ = _bounds_below_best(ctx, gbs)
        assert fit >= 30
        checked += assert_bounds_below_estimates(ctx, gbs, 1024, per_config=4, **training)
    assert checked >= 300
