"""The search: the plan with the lowest predicted step time whose predicted memory fits.

Outer loop: every mesh and schedule configuration: tp dividing the node and heads, kv_heads and
ffn_hidden (TP groups stay inside a node); pp; dp = gpus / (tp pp) dividing the global batch;
micro-batch size; gpipe, 1f1b or interleaved 1f1b with v chunks per rank; sequence parallelism;
placement (mesh.order with pp or dp outermost, TP innermost; orders that put every rank on the same
node count once: planner.stages.distinct_orders); and, when the space asks for it,
one ZeRO level or one recompute mode for the whole plan. The inner problem of a configuration
(partition, per-stage ZeRO level, per-layer recompute) is planner.partition's, priced by planner.stages.

Every plan's step time under planner.cost.estimate is at least
    LB = max_r ( m W_r + sync_r ,  sum_{s<r} (f_s + b_s + p2p) + m W_r + sync_0 ) + max_r tail_r
with m micro-batches, W_r the per-micro-batch work of pipeline rank r (its stages' forward and
backward, and its own sends when they block), f_s, b_s those of stage s, tail = optimizer +
ZeRO-1/2 gather, sync its first stage's gradient synchronisation (none where that runs beside
its last backward: planner.comm.reduce_beside_backward): rank r works serially, cannot start
before micro-batch 0 has come through stages 0..r-1, and its last backward still has to flow
back through them before rank 0 can finish (the
second term less rank r's last send back, when sends block: m W_r has it already); every rank's
optimizer step waits for the gradient norm over all of them (planner.cost).
With v > 1 chunks a rank (interleaved 1F1B), also LB >= sum_s (f_s + b_s): micro-batch 0 goes
forward through every stage and back.

Configurations wait in a priority queue keyed by a lower bound and are taken cheapest first:
(1) the config bound: all layers at their cheapest, averaged over ranks, with the 1F1B fill
Wtot / (1 - (1 - 1/m)^p) for v = 1 and micro-batch 0's way through every stage for v > 1; (2) on
first pop, a memory-aware balance bound that also counts each block's data-parallel
communication and copies, the embedding and head, each chunk's first block, and that a rank runs
whole blocks (planner.bounds.Bounds.balance_bound); (3) on the next pop the candidates are generated and
priced with the full estimate in increasing LB order, until LB reaches the K-th best price found
(one recomputing at least what a priced one that fits does is skipped: partition.recomputes_more).
Until K plans are priced, the first partition of a large inner problem is priced when found, so
that the bound on k (blocks a stage) has an incumbent to work with. The search stops when the
queue's smallest key reaches the K-th best price. All three keys are valid lower
bounds when the inner problem is enumerated (few layers and options: exact, which the tests check
against brute force); for large inner problems the dynamic programme first yields the partition
at the best bottleneck (with several chunks a rank, polished by moving blocks, as the full sweep
does, beside the split balancing ranks at that bottleneck), whose LB is used as the key before
the full threshold sweep (a heuristic: it is not a bound on that configuration's other
partitions; where that partition does not fit, the key stays the configuration's bound).
`SearchSpace.thorough` keeps the configuration's bound as its key: on 48 problems with top 1 it
found 1 plan 1.4% faster, at 1.5x the time (docs/HISTORY.md, session 25).
"""
from __future__ import annotations

import dataclasses
import heapq
import math
import time
from dataclasses import dataclass
from types import SimpleNamespace

from planner.cluster import ClusterSpec
from planner.comm import overlap_steal
from planner.cost import Estimate, estimate
from planner.layers import layer_cost
from planner.precision import model_state_bytes, optimizer_step_bytes, sharded_param_bytes
from planner.model import RECOMPUTE_MODES, ConfigError, ModelConfig
from planner.partition import Inner, backward_s, recomputes_more
from planner.plan import DTYPES, RUNTIME_RECV_BUFFERS, Mesh, Plan, Training
from planner.build import build_plan, even_stages
from planner.bounds import in_flight_counts
from planner.stages import TOL, MenuCache
from planner.configs import Config, SearchSpace, configs, no_configuration  # the outer loop
from planner.schedule import Sharing

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


RANK_BALANCED_PRICED = 3  # of a configuration's rank-balanced splits (planner.rank_split)


def _mesh(cfg) -> Mesh:
    """The mesh of a configuration (its rank order and degrees)."""
    return Mesh(order=list(cfg.order), pp=cfg.pp, dp=cfg.dp, tp=cfg.tp, cp=cfg.cp, dp_replicate=cfg.dp_replicate,
                ep=cfg.ep)


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

    def __init__(self, model, cluster, train: Training, limit, space: SearchSpace, model_profile=None):
        self.model, self.cluster, self.train, self.space = model, cluster, train, space
        self.profile = model_profile  # its layers price the partitions (search_profiled)
        # measured layer times are of `processes` sharing the cluster's compute: as work (Sharing.work)
        sharing = (Sharing.of(cluster.compute_slots, cluster.world_size, 1, model_profile.processes)
                   if model_profile is not None else None)
        self.work = sharing.work(1.0) if sharing is not None else 1.0
        self.steal = overlap_steal(cluster)  # of the compute rate, while a collective runs beside it
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
        self._fsdp_extra: dict = {}  # planner.fsdp_memory.fsdp_extra_parts of a stage's blocks and root
        self._blocks: dict = {}
        self._flight: dict = {}
        self._recv: dict = {}  # planner.stages.StageCosts._recv
        # the pipeline's receive buffers, whether a stage keeps its sent outputs, scatter-gather
        # transfers (search() sets them: planner.plan.Pipeline's recv_buffers, sent_outputs, p2p)
        self.recv_buffers, self.sent_kept, self.scatter_p2p = RUNTIME_RECV_BUFFERS, True, False
        self._even: dict = {}  # planner.partition.Inner._even_sizes

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
        return self._group(cfg, "shard_group")

    def experts(self, cfg):
        """collectives' of the ranks holding the same experts under expert parallelism
        (Mesh.expert_shard_group: ZeRO shards the experts and reduces their gradients there); None
        without it."""
        return self._group(cfg, "expert_shard_group") if cfg.ep > 1 else None

    def _group(self, cfg, group: str):
        key = (cfg.tp, cfg.pp, cfg.dp, cfg.cp, cfg.order, cfg.dp_replicate, cfg.ep if group != "shard_group" else 1, group)
        if key not in self._coll:
            ranks = getattr(_mesh(cfg), group)(pp=0, tp=0)
            self._coll[key] = tuple(_affine(self.cluster, op, ranks) for op in ("all_gather", "all_reduce", "reduce_scatter")) \
                + (self.cluster.group_shape(ranks),)
        return self._coll[key]

    def replicas(self, cfg):
        """HSDP's all-reduce across the replicas of pipeline rank 0's shards, as a time function,
        and the replica group's shape (None without HSDP)."""
        if cfg.dp_replicate == 1:
            return (lambda n: 0.0), None
        key = (cfg.tp, cfg.pp, cfg.dp, cfg.cp, cfg.order, cfg.dp_replicate, "replicas")
        if key not in self._coll:
            ranks = _mesh(cfg).replicate_group(pp=0, tp=0)
            self._coll[key] = _affine(self.cluster, "all_reduce", ranks), self.cluster.group_shape(ranks)
        return self._coll[key]

    def layers(self, tp, b, sp, multi, dp1, split=False, cp=1, cfg=None):
        """LayerCost of the embedding, the head and a block per recompute mode (`dp1`: without data
        parallelism, where the runtime casts its weights at each use: precision.autocast_cast_bytes;
        `split`: under a split backward, planner.plan.split_backward; `cp`: context parallelism,
        whose K/V collectives count here as the layer's TP communication, exposed as that is; `cfg`:
        a configuration with expert parallelism, whose blocks hold experts / ep of the experts and
        exchange rows over its EP group (counted as TP communication too), which the costs depend
        on by that group's shape)."""
        ep = cfg.ep if cfg is not None else 1
        group = self.cluster.group_shape(_mesh(cfg).expert_group(pp=0, dp=0, cp=0, tp=0)) if ep > 1 else None
        key = (tp, b, sp, multi, dp1, split, cp, ep, group)
        if key not in self._layers:
            m = self.model
            mesh = Mesh(pp=2 if split else 1, dp=1 if dp1 else 2, tp=tp, cp=cp, order=["pp", "dp", "cp", "tp"])
            if ep > 1:  # the configuration's own mesh, for its EP group
                mesh = _mesh(cfg)
            fake = SimpleNamespace(model=m, training=dataclasses.replace(self.train, micro_batch=b), mesh=mesh,
                                   pipeline=SimpleNamespace(micro_batches=2 if multi else 1,
                                                            schedule="zbv" if split else "1f1b"))
            ranks = list(range(tp))

            def lc(i, rec):
                c = layer_cost(fake, self.cluster, i, SimpleNamespace(sequence_parallel=sp, recompute=[rec], start=i),
                               ranks, self.profile, dp_extras=False)
                w = self.work
                return dataclasses.replace(c, fwd_compute_s=c.fwd_compute_s * w, bwd_compute_s=c.bwd_compute_s * w,
                                           bwd_weight_s=c.bwd_weight_s * w,
                                           fwd_tp_s=(c.fwd_tp_s + c.fwd_cp_s + c.fwd_ep_s) * w,
                                           bwd_tp_s=(c.bwd_tp_s + c.bwd_cp_s + c.bwd_ep_s) * w)
            self._layers[key] = dict(emb=lc(0, "none"), head=lc(m.layers + 1, "none"),
                                     blk={r: lc(1, r) for r in RECOMPUTE_MODES})
        return self._layers[key]


def search(model: ModelConfig, cluster: ClusterSpec, global_batch: int, seq_len: int | None = None,
           memory_limit_bytes: float | None = None, dtype: str = "bf16", top: int = 1,
           space: SearchSpace | None = None, progress=None, cutoff_s: float = math.inf, model_profile=None,
           recv_buffers: str = RUNTIME_RECV_BUFFERS, sent_outputs: str = "kept", p2p: str = "full",
           **training) -> SearchResult:
    """The `top` fastest plans (distinct configurations) that fit; see the module doc.
    `progress(done, total, best_step_s)` is called now and then; `training` overrides Training fields;
    `cutoff_s`: only plans faster than this are wanted (another search's K-th best, planner.sp_modes);
    `model_profile`: its layers' times and bytes price the plans (estimate without profile_extras:
    search_profiled re-prices the plans found with all of it); `recv_buffers`, `sent_outputs`, `p2p`:
    the pipeline's, as planner.plan.Pipeline has them (a framework's; the runtime's by default)."""
    t0 = time.perf_counter()
    space = space or SearchSpace()
    seq_len = seq_len or model.seq_len
    limit = memory_limit_bytes if memory_limit_bytes is not None else cluster.device.memory_bytes
    train = Training(global_batch=global_batch, micro_batch=1, seq_len=seq_len, dtype=dtype,
                     master_weights=dtype != "fp32", **training)
    ctx = Ctx(model, cluster, train, limit, space, model_profile)
    ctx.recv_buffers, ctx.sent_kept, ctx.scatter_p2p = recv_buffers, sent_outputs == "kept", p2p == "scatter-gather"
    res = SearchResult(results=[])

    def build(cfg, stages):
        return build_plan(model, cluster_name=cluster.name, device=cluster.device.name, nodes=cluster.nodes,
                          devices_per_node=cluster.devices_per_node, global_batch=global_batch,
                          micro_batch=cfg.micro_batch, seq_len=seq_len, tp=cfg.tp, pp=cfg.pp, dp=cfg.dp, cp=cfg.cp,
                          schedule=cfg.schedule, virtual_stages=cfg.v, dtype=dtype, dp_replicate=cfg.dp_replicate, ep=cfg.ep,
                          profile_hash=cluster.profile_hash, order=list(cfg.order), stages=stages,
                          recv_buffers=recv_buffers, sent_outputs=sent_outputs, p2p=p2p, **training)

    bounded, mem_lbs = [], []
    for cfg in configs(ctx, global_batch):
        res.configs += 1
        lb, mem = Inner(ctx, cfg).config_bound()
        mem_lbs.append((mem, res.configs, cfg))
        if mem > ctx.lim_eff * (1 + TOL):
            res.pruned_memory += 1
            continue
        bounded.append((lb, cfg))
    if not res.configs:
        raise ConfigError(no_configuration(ctx, global_batch))
    bounded.sort(key=lambda x: x[0])
    best: dict = {}  # config -> Found

    known = [None]  # kth's value until `best` changes

    def kth():
        """The top-th best step time of the configurations priced (cutoff_s until there are top):
        of configurations distinct but for HSDP's replica count, so that an HSDP twin priced
        beside its flat configuration prunes no more than that configuration alone."""
        if known[0] is None:
            twins: dict = {}
            for c, f in best.items():
                k = dataclasses.replace(c, dp_replicate=1) if c.dp_replicate > 1 else c
                twins[k] = min(twins.get(k, math.inf), f.estimate.step_time_s)
            known[0] = cutoff_s if len(twins) < top else min(cutoff_s, sorted(twins.values())[top - 1])
        return known[0]

    def price(cfg, inner, assign) -> bool:
        """Estimate an assignment's plan; keep it as the configuration's best if it fits and is faster.
        Whether it fits."""
        plan = inner.to_plan(assign, build)
        est = estimate(plan, cluster, memory_limit_bytes=limit, model_profile=model_profile, profile_extras=False)
        res.priced += 1
        mine = best.get(cfg)
        if est.fits and (mine is None or est.step_time_s < mine.estimate.step_time_s):
            best[cfg] = Found(plan, est, cfg)
            known[0] = None
        return est.fits

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
        # the candidates by bound (a few where not exhaustive), then the full sweep's rank-balanced
        # splits (several chunks a rank), a few of them besides; each while its bound can win
        # the configuration's assignments priced that fit; where the layers' times are measured (a
        # model profile) or processes share compute, more recomputation need not take longer
        fitted = [] if model_profile is None and cluster.compute_slots is None else None
        for group, budget in ((cands, None if inner.exhaustive else space.max_priced_per_config),
                              (inner.rank_balanced, RANK_BALANCED_PRICED)):
            # by bound; among equal bounds (a step that its communication paces) the least backward first
            for clb, assign in sorted(group, key=lambda x: (x[0], backward_s(x[1])))[:budget]:
                mine = best.get(cfg)
                if clb >= min(kth(), mine.estimate.step_time_s if mine else math.inf) * (1 - TOL):
                    break
                if fitted and any(recomputes_more(assign, a) for a in fitted):
                    continue  # no faster than a plan of its configuration that fits
                if price(cfg, inner, assign) and fitted is not None:
                    fitted.append(assign)
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
        est = estimate(build(cfg, stages), ctx.cluster, memory_limit_bytes=ctx.limit, model_profile=ctx.profile,
                       profile_extras=False)
        least = est.required_bytes if least is None else min(least, est.required_bytes)
    return least


PROFILED_POOL = 32  # plans found re-priced with all of a model profile


def profiled_space(space: SearchSpace, model_profile) -> SearchSpace:
    """`space` narrowed to what a model profile measured: the TP degrees whose embedding, head and
    block (in every recompute mode and sequence-parallel setting the space allows) it timed, and
    micro-batches up to its largest (its fits of time against micro-batch size are not trusted far
    outside the measured range)."""
    got = model_profile.entries

    def measured(tp):
        need = [("embedding", "none"), ("head", "none")] + [("block", r) for r in space.recompute]
        return all((layer, tp, sp and tp > 1, r, 1) in got for layer, r in need for sp in space.sequence_parallel)
    tps = tuple(sorted(tp for tp in {k[1] for k in got} if measured(tp) and (space.tp is None or tp in space.tp)))
    if not tps:
        raise ConfigError(f"model profile {model_profile.name}: no TP degree{' of --tp' if space.tp else ''} is "
                          f"measured for every layer and recompute mode searched; re-run `trident profile model` "
                          f"with --tp {','.join(str(t) for t in space.tp or (1,))}")
    largest = max(model_profile.micro_batches, default=None)
    mbs = space.micro_batch
    if largest is not None:
        mbs = tuple(b for b in (mbs or range(1, largest + 1)) if b <= largest)
        if not mbs:
            raise ConfigError(f"model profile {model_profile.name}: measured micro-batches up to {largest}, below "
                              f"every --micro-batch allowed; re-run `trident profile model` with --micro-batches "
                              f"including {min(space.micro_batch)}")
    return dataclasses.replace(space, tp=tps, micro_batch=mbs)


def search_profiled(model: ModelConfig, cluster: ClusterSpec, model_profile, global_batch: int,
                    top: int = 1, memory_limit_bytes: float | None = None, space: SearchSpace | None = None,
                    **kw) -> SearchResult:
    """The search with measured layer costs (planner.model_profile), over what the profile measured
    (profiled_space): the partitions are searched with the layers' measured times and bytes and
    everything else priced as without a profile (the search's bounds hold for that estimate, whose
    data-parallel costs the search prices itself); the PROFILED_POOL fastest distinct
    configurations are then re-priced with all of the profile (its measured data-parallel extras,
    optimizer step, pipeline and per-step overheads), which ranks them; plans that no longer fit are
    dropped."""
    from planner.cost import estimate
    res = search(model, cluster, global_batch=global_batch, memory_limit_bytes=memory_limit_bytes,
                 top=max(top, PROFILED_POOL), space=profiled_space(space or SearchSpace(), model_profile),
                 model_profile=model_profile, **kw)
    for f in res.results:
        f.estimate = estimate(f.plan, cluster, memory_limit_bytes=memory_limit_bytes, model_profile=model_profile)
    res.results = sorted((f for f in res.results if f.estimate.fits), key=lambda f: f.estimate.step_time_s)[:top]
    return res
