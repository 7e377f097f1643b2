"""The search: the plan with the lowest predicted step time whose predicted memory fits.

Outer loop: every mesh and schedule configuration: tp dividing the node and heads, kv_heads and
ffn_hidden (TP groups stay inside a node); pp; dp = gpus / (tp pp) dividing the global batch;
micro-batch size; gpipe, 1f1b or interleaved 1f1b with v chunks per rank; sequence parallelism;
placement (mesh.order with pp or dp outermost, TP innermost; orders that put every rank on the same
node count once: planner.stages.distinct_orders); and, when the space asks for it,
one ZeRO level or one recompute mode for the whole plan. The inner problem of a configuration
(partition, per-stage ZeRO level, per-layer recompute) is planner.partition's, priced by planner.stages.

Every plan's step time under planner.cost.estimate is at least
    LB = max_r ( m W_r + sync_r + tail_r ,  sum_{s<r} (f_s + b_s + p2p) + m W_r + sync_0 + tail_0 )
with m micro-batches, W_r the per-micro-batch work of pipeline rank r (its stages' forward and
backward, and its own sends when they block), f_s, b_s those of stage s, tail = optimizer +
ZeRO-1/2 gather: rank r works serially, cannot start before micro-batch 0 has come through stages
0..r-1, and its last backward still has to flow back through them before rank 0 can finish.
With v > 1 chunks a rank (interleaved 1F1B), also LB >= sum_s (f_s + b_s): micro-batch 0 goes
forward through every stage and back.

Configurations wait in a priority queue keyed by a lower bound and are taken cheapest first:
(1) the config bound: all layers at their cheapest, averaged over ranks, with the 1F1B fill
Wtot / (1 - (1 - 1/m)^p) for v = 1 and micro-batch 0's way through every stage for v > 1; (2) on
first pop, a memory-aware balance bound that also counts each block's data-parallel
communication and copies, the embedding and head, and each chunk's first block
(planner.bounds.Bounds.balance_bound); (3) on the next pop the candidates are generated and
priced with the full estimate in increasing LB order, until LB reaches the K-th best price found.
Until K plans are priced, the first partition of a large inner problem is priced when found, so
that the bound on k (blocks a stage) has an incumbent to work with. The search stops when the
queue's smallest key reaches the K-th best price. All three keys are valid lower
bounds when the inner problem is enumerated (few layers and options: exact, which the tests check
against brute force); for large inner problems the dynamic programme first yields the partition
at the best bottleneck (with several chunks a rank, polished by moving blocks, as the full sweep
does), whose LB is used as the key before the full threshold sweep (a heuristic: it is not a
bound on that configuration's other partitions; where that partition does not fit, the key stays
the configuration's bound). `SearchSpace.thorough` keeps the configuration's bound as its key:
on 48 problems with top 1 it found 1 plan 1.4% faster, at 1.5x the time (docs/HISTORY.md, session 25).
"""
from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import time
from dataclasses import dataclass
from types import SimpleNamespace

from planner.cluster import ClusterSpec
from planner.cost import Estimate, estimate
from planner.layers import layer_cost
from planner.precision import model_state_bytes, optimizer_step_bytes, sharded_param_bytes
from planner.model import RECOMPUTE_MODES, ConfigError, ModelConfig
from planner.partition import Inner
from planner.plan import DTYPES, SCHEDULES, Mesh, Plan, Training
from planner.plan_checks import MAX_MICRO_BATCHES
from planner.build import build_plan, even_stages
from planner.bounds import in_flight_counts
from planner.stages import TOL, MenuCache, distinct_orders

ORDERS = (("pp", "dp", "tp"), ("dp", "pp", "tp"))


@dataclass
class SearchSpace:
    """What the search may choose; None means every valid value."""
    tp: tuple | None = None
    pp: tuple | None = None
    dp: tuple | None = None
    micro_batch: tuple | None = None
    schedules: tuple = SCHEDULES
    virtual_stages: tuple = (2, 3, 4, 6, 8)  # chunks per rank for interleaved-1f1b
    zero: tuple = (0, 1, 2, 3)
    zero_per_stage: bool = True  # False: one ZeRO level for the whole plan
    recompute: tuple = RECOMPUTE_MODES
    recompute_granularity: str = "layer"  # layer (counts per stage) | stage | plan
    sequence_parallel: tuple = (False, True)
    orders: tuple = ORDERS
    uneven: bool = True  # False: only planner.plan.even_stages partitions
    exhaustive_limit: int = 3000  # inner assignments enumerated exhaustively up to this many
    max_priced_per_config: int = 6  # full estimates per configuration when not exhaustive
    # True: a large inner problem keeps its configuration bound as its key after the quick pass
    # (every configuration that bound cannot rule out gets the full sweep); False: the quick
    # split's bound, which is not a bound on the other splits (module doc), about 1.5x faster
    thorough: bool = False


@dataclass(frozen=True)
class Config:
    tp: int
    pp: int
    dp: int
    micro_batch: int
    micro_batches: int
    schedule: str
    v: int
    sp: bool
    order: tuple
    zero: int | None  # None: chosen per stage
    recompute: str | None  # None: chosen per stage / layer


@dataclass
class Found:
    plan: Plan
    estimate: Estimate
    config: Config


@dataclass
class SearchResult:
    results: list  # of Found, best first
    configs: int = 0
    pruned_memory: int = 0
    expanded: int = 0  # configurations whose partitions were searched
    priced: int = 0
    elapsed_s: float = 0.0
    min_required_bytes: float | None = None  # when nothing fits: the least a tried plan needs
    cutoff_s: float = math.inf  # the analytic step time of the K-th best plan found (planner.sp_modes)

    @property
    def best(self) -> Found | None:
        return self.results[0] if self.results else None


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _affine(cluster: ClusterSpec, op: str, ranks: list):
    """collective_time(op, n, ranks) as a function of n: a + c n for n > 0 (alpha-beta), computed
    once; a profile with per-message-size segments or curves is asked every time."""
    if len(ranks) <= 1:
        return lambda n: 0.0
    if not all(ab.affine for ab in cluster.collectives[op].values()):
        shape = cluster.group_shape(ranks)
        return lambda n: cluster.shaped_collective_time(op, n, shape)
    t1, t2 = cluster.collective_time(op, 1.0, ranks), cluster.collective_time(op, 2.0, ranks)
    c = t2 - t1
    a = t1 - c
    return lambda n: a + c * n if n > 0 else 0.0


class Ctx:
    """Per-search constants and caches."""

    def __init__(self, model, cluster, train: Training, limit, space: SearchSpace):
        self.model, self.cluster, self.train, self.space = model, cluster, train, space
        dev = cluster.device
        self.limit = limit
        self.lim_eff = (limit - dev.reserved_bytes) / (1 + dev.allocator_overhead_fraction)
        self.e = DTYPES[train.dtype]
        self.pb, self.gb, self.ob = model_state_bytes(train)  # with data parallelism
        self.states_dp1 = model_state_bytes(train, dp=1)
        self.osb = optimizer_step_bytes(train)  # per parameter the optimizer step moves
        self.spb = sharded_param_bytes(train)  # per parameter of FSDP2's shard beyond the optimizer state
        self.bw = dev.memory_bytes_per_s
        self._layers: dict = {}
        self._menus = MenuCache()
        self._combos: dict = {}
        self._coll: dict = {}
        self._coll_times: dict = {}  # (data-parallel group shape, parameters) -> its collectives' times
        self._fsdp_extra: dict = {}  # planner.memory.fsdp_extra_parts of a stage's blocks and root
        self._blocks: dict = {}
        self._flight: dict = {}

    def in_flight(self, cfg):
        """planner.bounds.in_flight_counts of the configuration's schedule, cached."""
        key = (cfg.schedule, cfg.pp, cfg.v, cfg.micro_batches)
        if key not in self._flight:
            self._flight[key] = in_flight_counts(*key)
        return self._flight[key]

    def collectives(self, cfg):
        """(all-gather, all-reduce, reduce-scatter) time functions of the data-parallel group of
        pipeline rank 0 (every rank's group has the same shape when TP is innermost), and that
        group's shape (ClusterSpec.group_shape: all the three depend on)."""
        key = (cfg.tp, cfg.pp, cfg.dp, cfg.order)
        if key not in self._coll:
            ranks = Mesh(order=list(cfg.order), pp=cfg.pp, dp=cfg.dp, tp=cfg.tp).group("dp", pp=0, tp=0)
            self._coll[key] = tuple(_affine(self.cluster, op, ranks) for op in ("all_gather", "all_reduce", "reduce_scatter")) \
                + (self.cluster.group_shape(ranks),)
        return self._coll[key]

    def layers(self, tp, b, sp, multi, dp1, split=False):
        """LayerCost of the embedding, the head and a block per recompute mode (`dp1`: without data
        parallelism, where the runtime casts its weights at each use: precision.autocast_cast_bytes;
        `split`: under a split backward, planner.plan.split_backward)."""
        key = (tp, b, sp, multi, dp1, split)
        if key not in self._layers:
            m = self.model
            fake = SimpleNamespace(model=m, training=dataclasses.replace(self.train, micro_batch=b),
                                   mesh=SimpleNamespace(tp=tp, dp=1 if dp1 else 2, pp=2 if split else 1),
                                   pipeline=SimpleNamespace(micro_batches=2 if multi else 1,
                                                            schedule="zbv" if split else "1f1b"))
            ranks = list(range(tp))

            def lc(i, rec):
                return layer_cost(fake, self.cluster, i, SimpleNamespace(sequence_parallel=sp, recompute=[rec], start=i), ranks)
            self._layers[key] = dict(emb=lc(0, "none"), head=lc(m.layers + 1, "none"),
                                     blk={r: lc(1, r) for r in RECOMPUTE_MODES})
        return self._layers[key]


def _configs(ctx: Ctx, global_batch: int):
    m, c, sp_ = ctx.model, ctx.cluster, ctx.space
    world, dpn, total = c.world_size, c.devices_per_node, m.num_layers_total
    for tp in _divisors(dpn):
        if any(x % tp for x in (m.heads, m.kv_heads, m.ffn_hidden)) or (sp_.tp and tp not in sp_.tp) or world % tp:
            continue
        for pp in _divisors(world // tp):
            if pp > total or (sp_.pp and pp not in sp_.pp):
                continue
            dp = world // (tp * pp)
            if global_batch % dp or (sp_.dp and dp not in sp_.dp):
                continue
            for b in _divisors(global_batch // dp):
                if sp_.micro_batch and b not in sp_.micro_batch:
                    continue
                mbs = global_batch // (dp * b)
                if mbs > MAX_MICRO_BATCHES:
                    continue
                scheds = []
                for s in sp_.schedules:
                    if pp == 1:
                        scheds += [("1f1b", 1)] if ("1f1b", 1) not in scheds else []
                    elif s == "interleaved-1f1b":
                        scheds += [(s, v) for v in sp_.virtual_stages if v > 1 and pp * v <= total and mbs % pp == 0]
                    elif s == "zbv":
                        if 2 * pp <= total:
                            scheds.append((s, 2))
                    elif s == "gpipe" or mbs >= pp:  # 1F1B needs a micro-batch per stage (planner.plan)
                        scheds.append((s, 1))
                sps = [x for x in sp_.sequence_parallel if tp > 1 or not x] or [False]
                orders = distinct_orders(c, tp, pp, dp, sp_.orders) if (pp > 1 and dp > 1) else sp_.orders[:1]
                zeros = [None] if sp_.zero_per_stage else (sp_.zero if dp > 1 else sp_.zero[:1])
                recs = sp_.recompute if sp_.recompute_granularity == "plan" else [None]
                for (sched, v), sp, order, z, r in itertools.product(scheds, sps, orders, zeros, recs):
                    yield Config(tp, pp, dp, b, mbs, sched, v, sp, tuple(order), z, r)


# the user's constraints on a search (SearchSpace fields), by the command-line option that sets them
CONSTRAINTS = {"tp": "--tp", "pp": "--pp", "dp": "--dp", "micro_batch": "--micro-batch", "schedules": "--schedule",
               "virtual_stages": "--virtual-stages", "sequence_parallel": "--sequence-parallel"}


def _no_configuration(ctx: Ctx, global_batch: int) -> str:
    """Why no configuration exists: the one constraint that, lifted, would admit some (named, with
    the values that would work), else the problem itself."""
    m, c, space = ctx.model, ctx.cluster, ctx.space
    default = SearchSpace()
    where = f"{global_batch} sequences on {c.world_size} GPUs of {m.name}"
    given = {f: getattr(space, f) for f in CONSTRAINTS if getattr(space, f) != getattr(default, f)}
    for field in given:
        lifted = Ctx(m, c, ctx.train, ctx.limit, dataclasses.replace(space, **{field: getattr(default, field)}))
        cfgs = list(_configs(lifted, global_batch))
        if not cfgs:
            continue
        attr = {"schedules": "schedule", "virtual_stages": "v", "sequence_parallel": "sp"}.get(field, field)
        ok = sorted({getattr(cfg, attr) for cfg in cfgs if field != "virtual_stages" or cfg.v > 1})
        show = lambda vals: ", ".join("on" if v is True else "off" if v is False else str(v) for v in vals)  # noqa: E731
        return (f"{CONSTRAINTS[field]}: {show(given[field])} admits no configuration of {where} with the other "
                f"choices; possible: {show(ok) or 'none'}")
    if given:
        opts = " ".join(f"{CONSTRAINTS[f]} {','.join(str(v) for v in vals)}" for f, vals in given.items())
        return f"{opts}: together these admit no configuration of {where}; lift one of them"
    return (f"global_batch: {global_batch} sequences admit no configuration on {c.world_size} GPUs of {m.name} "
            f"(dp must divide it, tp the heads, and a data-parallel rank may run at most {MAX_MICRO_BATCHES} "
            f"micro-batches); use a multiple of the GPU count")


def search(model: ModelConfig, cluster: ClusterSpec, global_batch: int, seq_len: int | None = None,
           memory_limit_bytes: float | None = None, dtype: str = "bf16", top: int = 1,
           space: SearchSpace | None = None, progress=None, cutoff_s: float = math.inf, **training) -> SearchResult:
    """The `top` fastest plans (distinct configurations) that fit; see the module doc.
    `progress(done, total, best_step_s)` is called now and then; `training` overrides Training fields;
    `cutoff_s`: only plans faster than this are wanted (another search's K-th best, planner.sp_modes)."""
    t0 = time.perf_counter()
    space = space or SearchSpace()
    seq_len = seq_len or model.seq_len
    limit = memory_limit_bytes if memory_limit_bytes is not None else cluster.device.memory_bytes
    train = Training(global_batch=global_batch, micro_batch=1, seq_len=seq_len, dtype=dtype,
                     master_weights=dtype != "fp32", **training)
    ctx = Ctx(model, cluster, train, limit, space)
    res = SearchResult(results=[])

    def build(cfg, stages):
        return build_plan(model, cluster_name=cluster.name, device=cluster.device.name, nodes=cluster.nodes,
                          devices_per_node=cluster.devices_per_node, global_batch=global_batch,
                          micro_batch=cfg.micro_batch, seq_len=seq_len, tp=cfg.tp, pp=cfg.pp, dp=cfg.dp,
                          schedule=cfg.schedule, virtual_stages=cfg.v, dtype=dtype,
                          profile_hash=cluster.profile_hash, order=list(cfg.order), stages=stages, **training)

    bounded, mem_lbs = [], []
    for cfg in _configs(ctx, global_batch):
        res.configs += 1
        lb, mem = Inner(ctx, cfg).config_bound()
        mem_lbs.append((mem, res.configs, cfg))
        if mem > ctx.lim_eff * (1 + TOL):
            res.pruned_memory += 1
            continue
        bounded.append((lb, cfg))
    if not res.configs:
        raise ConfigError(_no_configuration(ctx, global_batch))
    bounded.sort(key=lambda x: x[0])
    best: dict = {}  # config -> Found

    def kth():
        if len(best) < top:
            return cutoff_s
        return min(cutoff_s, sorted(f.estimate.step_time_s for f in best.values())[top - 1])

    def price(cfg, inner, assign):
        """Estimate an assignment's plan; keep it as the configuration's best if it fits and is faster."""
        plan = inner.to_plan(assign, build)
        est = estimate(plan, cluster, memory_limit_bytes=limit)
        res.priced += 1
        mine = best.get(cfg)
        if est.fits and (mine is None or est.step_time_s < mine.estimate.step_time_s):
            best[cfg] = Found(plan, est, cfg)

    last = t0
    heap = [(lb, n, 0, cfg) for n, (lb, cfg) in enumerate(bounded)]
    heapq.heapify(heap)
    done = 0
    while heap:
        lb, n, tightened, cfg = heapq.heappop(heap)
        if progress and time.perf_counter() - last > 0.5:
            last = time.perf_counter()
            progress(done, len(bounded), min((f.estimate.step_time_s for f in best.values()), default=None))
        if lb >= kth() * (1 - TOL):
            break
        if not tightened:  # a stronger bound first, then back in the queue
            heapq.heappush(heap, (max(lb, Inner(ctx, cfg).balance_bound(kth())), n, 1, cfg))
            continue
        inner = Inner(ctx, cfg).setup()
        if tightened == 1:  # the partition at the best bottleneck alone first; the full sweep if still promising
            cands = inner.candidates(kth(), quick=True)
            if not inner.exhaustive:
                if cands and len(best) < top:  # no incumbent yet: price this partition, to have one
                    price(cfg, inner, min(cands, key=lambda x: x[0])[1])
                # no quick split that fits says nothing of the others: the full sweep decides
                quick_lb = lb if space.thorough else min((c[0] for c in cands), default=lb)
                heapq.heappush(heap, (max(lb, quick_lb), n, 2, cfg))
                continue
        else:
            cands = inner.candidates(kth())
        done += 1
        res.expanded = done
        cands = sorted(cands, key=lambda x: x[0])
        priced = 0
        for clb, assign in cands:
            mine = best.get(cfg)
            if clb >= min(kth(), mine.estimate.step_time_s if mine else math.inf) * (1 - TOL):
                break
            if not inner.exhaustive and priced >= space.max_priced_per_config:
                break
            price(cfg, inner, assign)
            priced += 1
    res.results = sorted(best.values(), key=lambda f: f.estimate.step_time_s)[:top]
    res.cutoff_s = kth()
    if not res.results and cutoff_s == math.inf:
        res.min_required_bytes = _least_memory(ctx, [c for _, _, c in sorted(mem_lbs)], build)
    res.elapsed_s = time.perf_counter() - t0
    return res


def _least_memory(ctx, cfgs, build, tries=8):
    """When nothing fits: the required bytes of the most frugal setting (highest ZeRO level, most
    recomputation, even split) of the `tries` configurations with the smallest memory bound."""
    least = None
    for cfg in cfgs[:tries]:
        z = max(ctx.space.zero) if cfg.zero is None else cfg.zero
        rec = cfg.recompute or next((r for r in ("full", "selective", "none") if r in ctx.space.recompute), "none")
        stages = even_stages(ctx.model, cfg.pp, cfg.v, z, rec, cfg.sp)
        est = estimate(build(cfg, stages), ctx.cluster, memory_limit_bytes=ctx.limit)
        least = est.required_bytes if least is None else min(least, est.required_bytes)
    return least


PROFILED_POOL = 32  # analytic finalists re-priced with a model profile


def search_profiled(model: ModelConfig, cluster: ClusterSpec, model_profile, global_batch: int,
                    top: int = 1, memory_limit_bytes: float | None = None, **kw) -> SearchResult:
    """The search with measured layer costs (planner.model_profile): the partitions are searched
    with the analytic costs, and the PROFILED_POOL fastest distinct configurations are re-priced
    with the model profile, which then ranks them; plans that no longer fit are dropped, and so
    are plans whose micro-batch is larger than the largest the profile measured (the fits of time
    against micro-batch size are not trusted far outside the measured range)."""
    from planner.cost import estimate
    res = search(model, cluster, global_batch=global_batch, memory_limit_bytes=memory_limit_bytes,
                 top=max(top, PROFILED_POOL), **kw)
    largest = max(model_profile.micro_batches, default=None)
    kept = [f for f in res.results if largest is None or f.plan.training.micro_batch <= largest] or res.results
    for f in kept:
        f.estimate = estimate(f.plan, cluster, memory_limit_bytes=memory_limit_bytes, model_profile=model_profile)
    res.results = sorted((f for f in kept if f.estimate.fits), key=lambda f: f.estimate.step_time_s)[:top]
    return res
