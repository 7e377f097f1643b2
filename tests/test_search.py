"""The search: it finds what an exhaustive enumeration finds, and what it returns always fits."""
import dataclasses
import itertools
import math

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from planner.cluster import load_cluster
from planner.cost import estimate
from planner.plan import Stage
from planner.build import build_plan
from planner.search import SearchSpace, search
from planner.stages import MIXED_MODES, distinct_orders
from planner.zoo import ZOO

GiB = 2**30
A100 = load_cluster("dgx-a100-80gb")


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def compositions(blocks, stages):
    """Block counts per stage: the first and last stages (embedding, head) may hold none."""
    if stages == 1:
        yield (blocks,)
        return
    for cuts in itertools.combinations(range(blocks + 1), stages - 1):
        sizes = [b - a for a, b in zip((0, *cuts), (*cuts, blocks))]
        if all(s >= 1 for s in sizes[1:-1]):
            yield tuple(sizes)


def stages_of(model, sizes, per_stage):
    """per_stage: (zero, recompute, sequence parallel) of each stage."""
    out, start = [], 0
    for i, (k, (zero, rec, sp)) in enumerate(zip(sizes, per_stage)):
        n = k + (i == 0) + (i == len(sizes) - 1)
        modes = iter(rec) if isinstance(rec, tuple) else itertools.repeat(rec)  # a tuple: one mode per block
        recs = ["none" if model.layer_kind(l) != "block" else next(modes) for l in range(start, start + n)]
        out.append(Stage(layers=[start, start + n], zero=zero, recompute=recs, sequence_parallel=sp))
        start += n
    return out


def brute_force(model, cluster, gbs, seq, limit, space, per_stage_options, model_profile=None, **training):
    """The fastest fitting plan over every configuration and partition of the restricted space
    (`training`: Training fields every plan sets; `model_profile`: priced by its layers, as the
    search with one prices). A plan's estimate does not depend on the memory
    limit (fits is required_bytes <= limit), so each problem is priced once and its fastest fitting
    plan picked for every limit the tests ask about."""
    key = _key(model, cluster, gbs, seq, space, per_stage_options, training, model_profile)
    if key not in _PRICED:
        _PRICED[key] = sorted(_every_estimate(model, cluster, gbs, seq, space, per_stage_options, model_profile,
                                              **training),
                              key=lambda est: est.step_time_s)
    return next((est for est in _PRICED[key] if est.required_bytes <= limit), None)


_PRICED = {}  # brute_force's priced problems


def _key(model, cluster, gbs, seq, space, per_stage_options, training, model_profile=None) -> str:
    """brute_force's cache key of a problem."""
    options = (per_stage_options.__qualname__, *(c.cell_contents for c in per_stage_options.__closure__ or ()))
    return repr((model, cluster, gbs, seq, space, options, sorted(training.items()), id(model_profile)))


def _every_estimate(model, cluster, gbs, seq, space, per_stage_options, model_profile=None, **training):
    world, dpn = cluster.world_size, cluster.devices_per_node
    for tp, pp, cp in itertools.product(divisors(dpn), divisors(world), space.cp or (1,)):
        if world % (tp * pp * cp) or any(x % tp for x in (model.heads, model.kv_heads, model.ffn_hidden)) or seq % (2 * cp):
            continue
        if pp > model.layers + 2 or (space.tp and tp not in space.tp) or (space.pp and pp not in space.pp):
            continue
        dp = world // (tp * pp * cp)
        if gbs % dp:
            continue
        for b in divisors(gbs // dp):
            if space.micro_batch and b not in space.micro_batch:
                continue
            m = gbs // (dp * b)
            scheds = [("1f1b", 1)] if pp == 1 else [(s, 1) for s in space.schedules
                                                    if s == "gpipe" or (s == "1f1b" and m >= pp)]
            if pp > 1 and "interleaved-1f1b" in space.schedules and m % pp == 0:
                scheds += [("interleaved-1f1b", v) for v in space.virtual_stages if pp * v <= model.layers + 2]
            if pp > 1 and "zbv" in space.schedules and 2 * pp <= model.layers + 2:
                scheds += [("zbv", 2)]
            orders = [(*o[:-1], "cp", o[-1]) for o in space.orders] if cp > 1 else space.orders  # CP just outside TP
            orders = orders if (pp > 1 and dp > 1) else orders[:1]
            sps = [s for s in space.sequence_parallel if tp > 1 or not s] or [False]
            # expert parallelism: divisors of dp and of the experts, with ZeRO 1-3 on every stage
            eps = [d for d in divisors(dp) if model.moe is not None and model.moe.experts % d == 0] or [1]
            for (sched, v), order, sp, ep in itertools.product(scheds, orders, sps, eps):
                S = pp * v
                for sizes in compositions(model.layers, S):
                    for per in per_stage_options(S, dp * cp, sizes):
                        if sched == "zbv" and any(isinstance(r, tuple) and len(set(r)) > 1 for _, r in per):
                            continue  # the search recomputes one mode a stage under zbv
                        if ep > 1 and any(z == 0 for z, _ in per):
                            continue
                        plan = build_plan(model, cluster_name=cluster.name, device=cluster.device.name,
                                          nodes=cluster.nodes, devices_per_node=dpn, global_batch=gbs, micro_batch=b,
                                          seq_len=seq, tp=tp, pp=pp, dp=dp, cp=cp, schedule=sched, virtual_stages=v,
                                          order=list(order), stages=stages_of(model, sizes, [(*x, sp) for x in per]),
                                          ep=ep, **training)
                        yield estimate(plan, cluster, model_profile=model_profile, profile_extras=False)


def plan_level(zeros, recs):
    def options(S, dp, sizes):
        for z, r in itertools.product(zeros if dp > 1 else zeros[:1], recs):
            yield [(z, r)] * S
    return options


def stage_level(zeros, recs):
    def options(S, dp, sizes):
        per = list(itertools.product(zeros if dp > 1 else zeros[:1], recs))
        yield from itertools.product(per, repeat=S)
    return options


def layer_level(zeros, recs, mixed=MIXED_MODES):
    """Per stage a ZeRO level and, per block, a recompute mode (only the counts matter to the cost
    model, so every multiset of modes once), at most `mixed` modes a stage (the search's space)."""
    def options(S, dp, sizes):
        per_stage = [list(itertools.product(zeros if dp > 1 else zeros[:1],
                                            [c for c in itertools.combinations_with_replacement(recs, k)
                                             if len(set(c)) <= mixed])) for k in sizes]
        yield from itertools.product(*per_stage)
    return options


def shrunk(layers, hidden=1024):
    return dataclasses.replace(ZOO["llama2-7b"], name="shrunk", layers=layers, hidden=hidden, ffn_hidden=hidden * 3,
                               heads=8, kv_heads=8, vocab=8000, seq_len=1024)


def check_same(model, cluster, gbs, seq, limit, space, options, model_profile=None, **training):
    found = search(model, cluster, global_batch=gbs, seq_len=seq, memory_limit_bytes=limit, space=space,
                   model_profile=model_profile, **training)
    want = brute_force(model, cluster, gbs, seq, limit, space, options, model_profile, **training)
    if want is None:
        assert found.best is None
    else:
        assert found.best is not None, f"search found nothing; brute force {want.step_time_s}"
        assert found.best.estimate.step_time_s == pytest.approx(want.step_time_s, rel=1e-9)
    return found.best


@settings(max_examples=5, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(layers=st.integers(2, 6), gpus=st.sampled_from([2, 4, 8]), gbs=st.sampled_from([4, 8]),
       limit=st.sampled_from([3.0, 6.0, 80.0]))
def test_search_equals_exhaustive_enumeration(layers, gpus, gbs, limit):
    """Plan-level ZeRO and recompute, every partition (uneven too), mesh, micro-batch, schedule, order."""
    space = SearchSpace(zero=(0, 3), zero_per_stage=False, recompute=("none", "full"), recompute_granularity="plan",
                        virtual_stages=(2,), sequence_parallel=(False, True))
    check_same(shrunk(layers), A100.shaped_as(1, gpus), gbs, 1024, limit * GiB, space,
               plan_level((0, 3), ("none", "full")))


@settings(max_examples=3, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(layers=st.integers(3, 6), gpus=st.sampled_from([4, 8]), limit=st.sampled_from([3.0, 6.0, 80.0]))
def test_dynamic_programme_alone_is_close_to_exhaustive(layers, gpus, limit):
    """With enumeration switched off (what large instances use) the result stays within 3%."""
    space = SearchSpace(zero=(0, 3), zero_per_stage=False, recompute=("none", "full"), recompute_granularity="plan",
                        virtual_stages=(2,), exhaustive_limit=0)
    model, cluster = shrunk(layers), A100.shaped_as(1, gpus)
    found = search(model, cluster, global_batch=8, seq_len=1024, memory_limit_bytes=limit * GiB, space=space)
    want = brute_force(model, cluster, 8, 1024, limit * GiB, space, plan_level((0, 3), ("none", "full")))
    assert (found.best is None) == (want is None)
    if want is not None:
        assert found.best.estimate.step_time_s <= want.step_time_s * 1.03


@pytest.mark.parametrize("limit", [2.5, 4.0, 80.0])
def test_per_stage_choices_equal_exhaustive_enumeration(limit):
    """ZeRO level and recompute mode chosen per stage (16 GPUs over two nodes, 8 layers)."""
    space = SearchSpace(tp=(4,), pp=(2,), micro_batch=(1,), zero=(1, 3), zero_per_stage=True,
                        recompute=("none", "full"), recompute_granularity="stage", schedules=("1f1b",),
                        sequence_parallel=(True,))
    check_same(shrunk(8, 512), A100.with_nodes(2), 8, 1024, limit * GiB, space,
               stage_level((1, 3), ("none", "full")))


@pytest.mark.parametrize("limit", [1.2, 1.3, 1.4, 1.5, 80.0])
def test_interleaved_per_stage_recompute_equals_exhaustive_enumeration(limit):
    """Interleaved 1F1B (two chunks per rank, whose memory adds up on the rank), recompute per stage."""
    space = SearchSpace(tp=(2,), pp=(2,), micro_batch=(4,), zero=(3,), zero_per_stage=False,
                        recompute=("none", "full"), recompute_granularity="stage", schedules=("interleaved-1f1b",),
                        virtual_stages=(2,), sequence_parallel=(True,), orders=(("pp", "dp", "tp"),))
    check_same(shrunk(6, 512), A100.shaped_as(1, 8), 32, 1024, limit * GiB, space,
               stage_level((3,), ("none", "full")))


@pytest.mark.parametrize("limit", [1.2, 1.4, 80.0])  # 1F1B with a ZeRO-3 stage; ZB-V with a ZeRO-2 one; ZB-V
def test_zbv_per_stage_zero_equals_exhaustive_enumeration(limit):
    """ZB-V (two stages a rank in a V, the first and last on rank 0) beside 1F1B, ZeRO 1, 2 or 3
    per stage (few enough for the search to enumerate every assignment), no recomputation (what
    the runtime runs ZB-V with): the search's V placement, its memory (ZeRO 2/3 under the split
    backward gather and reduce a whole chunk) and its bounds find what enumerating every
    partition finds."""
    space = SearchSpace(pp=(2,), micro_batch=(1, 2), zero=(1, 2, 3), zero_per_stage=True, recompute=("none",),
                        recompute_granularity="stage", schedules=("1f1b", "zbv"), sequence_parallel=(False,),
                        orders=(("pp", "dp", "tp"),))
    check_same(shrunk(6, 512), A100.shaped_as(1, 8), 16, 1024, limit * GiB, space,
               stage_level((1, 2, 3), ("none",)))


@pytest.mark.parametrize("limit", [1.47, 1.52, 80.0])
def test_zbv_with_recomputation_equals_exhaustive_enumeration(limit):
    """ZB-V with recomputation chosen per layer (none / selective / full counts per stage) beside
    1F1B: a fully recomputed block replays in I and keeps the replay to W (runtime.recompute), so
    under ZB-V the memory also counts what each chunk holds from its I to its W; the search finds
    what enumerating every partition finds. At 1.52 GiB the fastest plan is ZB-V recomputing one
    block (8.5 ms against 1F1B's 9.2 ms without recomputation)."""
    space = SearchSpace(pp=(2,), micro_batch=(2,), zero=(0,), recompute_granularity="layer",
                        schedules=("1f1b", "zbv"), sequence_parallel=(False,), orders=(("pp", "dp", "tp"),))
    best = check_same(shrunk(4, 512), A100.shaped_as(1, 4), 16, 1024, limit * GiB, space,
                      layer_level((0,), ("none", "selective", "full")))
    if limit == 1.52:
        assert best.plan.pipeline.schedule == "zbv"
        assert any(r == "full" for st in best.plan.pipeline.stages for r in st.recompute)


@pytest.mark.parametrize("limit", [1.4, 80.0])
def test_shared_compute_keeps_the_search_exact(limit):
    """On processes that share compute (a CPU machine: 8 processes on 2 cores) the search bounds a
    plan by the work all its processes do at most that fast; it still finds what enumerating every
    partition finds."""
    space = SearchSpace(pp=(1, 2), micro_batch=(1, 2), zero=(1, 3), zero_per_stage=True, recompute=("none",),
                        recompute_granularity="stage", schedules=("1f1b", "zbv"), sequence_parallel=(False,),
                        orders=(("pp", "dp", "tp"),))
    shared = dataclasses.replace(A100.shaped_as(1, 8), compute_slots=2.0)
    check_same(shrunk(6, 512), shared, 16, 1024, limit * GiB, space, stage_level((1, 3), ("none",)))


@pytest.mark.parametrize("limit,training", [(1.17, dict(attention="flash")), (1.2, dict(attention="unfused")),
                                            (1.25, dict(attention="unfused")), (1.4, dict(attention="unfused")),
                                            (80.0, dict(attention="flash")), (1.15, dict(selective_recompute="ops")),
                                            (1.2, dict(selective_recompute="ops"))])
def test_per_layer_recompute_equals_exhaustive_enumeration(limit, training):
    """Recompute chosen per layer (none / selective / full counts per stage, at most two of them
    a stage), ZeRO per stage; mixing all three would find nothing faster here (planner.stages). With
    the materialized softmax (unfused) or torchtitan's per-op policy (planner.sac) selective
    recomputation saves memory; these limits make the search mix recompute modes within a stage."""
    space = SearchSpace(tp=(2,), pp=(2,), micro_batch=(2,), zero=(0, 3), recompute_granularity="layer",
                        schedules=("1f1b",), sequence_parallel=(False,), orders=(("pp", "dp", "tp"),))
    model, cluster, modes = shrunk(5, 512), A100.shaped_as(1, 8), ("none", "selective", "full")
    best = check_same(model, cluster, 8, 1024, limit * GiB, space, layer_level((0, 3), modes), **training)
    three = brute_force(model, cluster, 8, 1024, limit * GiB, space, layer_level((0, 3), modes, mixed=3), **training)
    assert (best is None) == (three is None)
    if three is not None:
        assert best.estimate.step_time_s == pytest.approx(three.step_time_s, rel=1e-9)


MEGATRON = dict(elementwise_kernels="fused-fp32-loss", grad_accumulation="fused", fsdp_copies=False,
                async_tp_allreduce=True, overlap_param_gather=False)


@pytest.mark.parametrize("pipeline", [dict(sent_outputs="freed", p2p="scatter-gather"),
                                      dict(recv_buffers="preallocated")])
def test_a_frameworks_settings_keep_the_search_exact(pipeline):
    """Searching for a plan Megatron-LM runs (`trident search --elementwise-kernels fused-fp32-loss
    --grad-accumulation fused --no-fsdp-copies --async-tp-allreduce --no-overlap-param-gather
    --sent-outputs freed --p2p scatter-gather`), or with torch.distributed.pipelining's own
    receive buffers: kernels (fused SwiGLU's activations too), gradient accumulation, data-parallel
    buffers and the pipeline's transfers and buffers priced in the bounds as in the estimate, so
    the search finds what enumerating finds at a limit just above each plan of the time-memory
    front (with the runtime's transfers and buffers in the bounds, freed outputs and scatter-gather
    transfers gave a slower plan or none at every one of their 23 limits)."""
    space = SearchSpace(pp=(2,), zero=(0, 1, 3), zero_per_stage=False, recompute=("none", "full"),
                        recompute_granularity="plan", virtual_stages=(2,), sequence_parallel=(False, True))
    model, cluster, options = shrunk(4), A100.shaped_as(1, 4), plan_level((0, 1, 3), ("none", "full"))
    everything = brute_force(model, cluster, 8, 1024, math.inf, space, options, **MEGATRON, **pipeline)
    front, fastest = [], math.inf
    for est in sorted(_PRICED[_key(model, cluster, 8, 1024, space, options, {**MEGATRON, **pipeline})],
                      key=lambda est: est.required_bytes):
        if est.step_time_s < fastest:
            fastest = est.step_time_s
            front.append(est.required_bytes * (1 + 1e-7))
    assert len(front) > 5 and everything.step_time_s == fastest
    for limit in front:
        best = check_same(model, cluster, 8, 1024, limit, space, options, **MEGATRON, **pipeline)
        assert all(getattr(best.plan.training, k) == v for k, v in MEGATRON.items())
        assert all(getattr(best.plan.pipeline, k) == v for k, v in pipeline.items())


EP_SPACES = {  # a ZeRO level a stage, or ZB-V with the EP group across nodes (dp-pp-tp: dp ranks 4 apart)
    "stage": (SearchSpace(tp=(2,), pp=(1, 2), micro_batch=(1,), zero=(0, 1, 3), recompute=("none", "full"),
                          recompute_granularity="stage", schedules=("1f1b",), sequence_parallel=(False,)),
              stage_level((0, 1, 3), ("none", "full"))),
    "zbv": (SearchSpace(tp=(2,), pp=(2,), micro_batch=(1,), zero=(1, 3), zero_per_stage=False, recompute=("none", "full"),
                        recompute_granularity="plan", schedules=("1f1b", "zbv"), sequence_parallel=(False,)),
            plan_level((1, 3), ("none", "full")))}


@pytest.mark.parametrize("kind,limit,spread", [("stage", 1.45, True), ("stage", 1.5, True), ("stage", 2.0, False),
                                               ("zbv", 1.3, None), ("zbv", 1.4, True), ("zbv", 1.6, True),
                                               ("zbv", 80.0, False)])
def test_expert_parallel_degrees_equal_exhaustive_enumeration(kind, limit, spread):
    """A mixture-of-experts model (4 experts, top 2) on two nodes: the search chooses the
    expert-parallel degree with the rest (its experts' ZeRO state over dp / ep ranks, their
    collectives over those, the all-to-alls over the EP group) and finds what enumerating every
    degree, configuration and partition finds: plans that fit only with the experts spread where
    memory is short (`spread`: the best spreads them; None: nothing fits)."""
    from planner.moe import MoESpec
    model = dataclasses.replace(shrunk(4, 1024), name="shrunk-moe", moe=MoESpec(4, 2))
    space, options = EP_SPACES[kind]
    best = check_same(model, A100.with_nodes(2), 16, 1024, limit * GiB, space, options)
    assert (best is None) == (spread is None) and (best is None or (best.plan.mesh.ep > 1) == spread)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(name=st.sampled_from(["tiny", "small", "llama2-7b", "gpt-1.7b"]), layers=st.integers(2, 12),
       gpus=st.sampled_from([1, 2, 4, 8, 16]), gbs=st.sampled_from([1, 4, 8, 32]),
       limit=st.floats(0.5, 80.0), seq=st.sampled_from([64, 256, 1024]))
def test_returned_plans_fit(name, layers, gpus, gbs, limit, seq):
    model = dataclasses.replace(ZOO[name], layers=layers)
    cluster = A100.shaped_as(1, gpus) if gpus < 8 else A100.with_nodes(gpus // 8)
    seq = min(seq, model.seq_len)
    space = SearchSpace(virtual_stages=(2,), max_priced_per_config=2, exhaustive_limit=300)
    res = search(model, cluster, global_batch=gbs, seq_len=seq, memory_limit_bytes=limit * GiB, space=space, top=3)
    for f in res.results:
        again = estimate(f.plan, cluster, memory_limit_bytes=limit * GiB)
        assert again.fits and again.required_bytes <= limit * GiB
        assert again.step_time_s == f.estimate.step_time_s
    if not res.results:
        assert res.min_required_bytes is None or res.min_required_bytes > limit * GiB


def test_top_k_are_distinct_and_sorted():
    res = search(shrunk(4), A100.shaped_as(1, 8), global_batch=8, seq_len=1024, top=4)
    times = [f.estimate.step_time_s for f in res.results]
    assert len(times) == 4 and times == sorted(times)
    assert len({f.config for f in res.results}) == 4


def test_orders_that_place_every_rank_alike_are_searched_once():
    """On one node every rank order is the same placement: the search prices and lists it once.
    Across nodes pp-dp-tp and dp-pp-tp put other groups across the network: both are searched."""
    orders = SearchSpace().orders
    assert distinct_orders(A100.shaped_as(1, 8), 2, 2, 2, orders) == [orders[0]]
    assert distinct_orders(A100.shaped_as(2, 4), 2, 2, 2, orders) == list(orders)
    res = search(shrunk(4), A100.shaped_as(1, 8), global_batch=8, seq_len=1024, top=6,
                 space=SearchSpace(pp=(2,), dp=(2,)))
    assert res.results and {f.config.order for f in res.results} == {orders[0]}
    res = search(shrunk(4), A100.shaped_as(2, 4), global_batch=8, seq_len=1024, top=40,
                 space=SearchSpace(pp=(2,), dp=(2,)))
    assert {f.config.order for f in res.results} == set(orders)


def test_the_menu_cache_keeps_under_its_byte_budget(monkeypatch):
    """Stage menus are cached across configurations; a deep model's would take gigabytes."""
    import numpy as np

    from planner.stages import MenuCache
    monkeypatch.setattr(MenuCache, "MAX_BYTES", 10_000)
    cache = MenuCache()
    for i in range(10):
        cache[i] = {"f": np.zeros(500), "combo": np.zeros(100, dtype=int), "cb": [1, 2]}  # 4,800 bytes each
    assert cache.nbytes <= 10_000 and list(cache) == [8, 9]


def test_menus_built_together_are_those_built_one_block_count_at_a_time():
    """The search builds a stage kind's menus for many block counts at once (planner.menus): each
    must be the menu of its own block count, option for option and in c order, for every ZeRO
    level, with the embedding and the head, under a split backward (zbv) and where ZeRO-3's
    communication is exposed beside some options' backward."""
    import numpy as np

    from planner.partition import Inner
    from planner.plan import Training
    from planner.configs import configs as _configs
    from planner.search import Ctx

    model, cluster = ZOO["gpt3-175b"], A100.with_nodes(16)
    train = Training(global_batch=256, micro_batch=1, seq_len=model.seq_len, dtype="bf16", master_weights=True)
    checked, exposed = 0, 0
    for cfg in _configs(Ctx(model, cluster, train, cluster.device.memory_bytes, SearchSpace()), 256):
        if not (cfg.tp == 8 and cfg.micro_batch == 1 and cfg.pp in (2, 4) and cfg.schedule in ("1f1b", "zbv")):
            continue
        together = Inner(Ctx(model, cluster, train, cluster.device.memory_bytes, SearchSpace()), cfg).setup()
        for flags in ((True, False), (False, False), (False, True), (True, True)):
            ks = [0, 1, 2, 5, 9, 13] if flags != (False, False) else [1, 2, 5, 9, 13]
            got = together.menus(ks[::-1], *flags)
            for k in ks:
                alone = Inner(Ctx(model, cluster, train, cluster.device.memory_bytes, SearchSpace()), cfg).setup()
                one = alone.menu(k, *flags)
                for name in ("f", "b", "c", "sync", "opt", "gather", "fixed", "zero", "transient", "end", "act",
                             "replay", "combo", "held_iw", "cb", "order"):
                    assert np.array_equal(got[k][name], one[name]), (cfg, flags, k, name)
                assert set(got[k]["zero"]) == set(together.zeros)
                checked += 1
                exposed += bool(len(one["b"]) != sum(len(alone.blocks(k)[5]) for _ in together.zeros))
    assert checked >= 100 and exposed > 0  # some menus re-sorted beside exposed communication

