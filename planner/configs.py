"""The search's outer loop: what it may choose (SearchSpace), one mesh and schedule configuration
(Config), and every configuration of a problem (configs), or why there is none
(no_configuration). planner.search prices them."""
from __future__ import annotations

import copy
import dataclasses
import itertools
import math
from dataclasses import dataclass

from planner.hsdp import replica_counts
from planner.model import RECOMPUTE_MODES
from planner.plan import SCHEDULES
from planner.plan_checks import MAX_MICRO_BATCHES
from planner.stages import distinct_orders

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
    cp: tuple | None = None  # context-parallel degrees; None: cp_degrees
    # HSDP replica counts (mesh.dp_replicate) searched as a dimension of the configuration (None:
    # every valid count); by default flat data parallelism alone, and `trident search` splits the
    # plans found (planner.hsdp) unless --dp-replicate names the counts
    dp_replicate: tuple | None = (1,)
    # expert-parallel degrees (mesh.ep) of a mixture-of-experts model; None: every one the runtime
    # runs (ep_degrees); dense models search 1 alone
    ep: tuple | None = None
    orders: tuple = ORDERS
    uneven: bool = True  # False: only planner.plan.even_stages partitions
    exhaustive_limit: int = 3000  # inner assignments enumerated exhaustively up to this many
    max_priced_per_config: int = 6  # full estimates per configuration when not exhaustive
    # True: a large inner problem keeps its configuration bound as its key after the quick pass
    # (every configuration that bound cannot rule out gets the full sweep); False: the quick
    # split's bound, which is not a bound on the other splits (module doc), about 1.5x faster
    thorough: bool = False
    # with several chunks a rank the full sweep also tries rank-balanced splits
    # (planner.rank_split); False leaves them out (benchmarks/search_variants.py)
    rank_splits: bool = True
    # with several chunks a rank the quick pass tries the rank-balanced split at the best
    # bottleneck too (session 56); False: its stage-level split alone, as before
    quick_rank_split: bool = True


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
    cp: int = 1  # context parallelism (planner.mesh)
    dp_replicate: int = 1  # HSDP's replicas (planner.mesh): ZeRO shards within dp / dp_replicate
    ep: int = 1  # expert parallelism (planner.moe): experts spread over ep of the shard group's dp ranks

    @property
    def shards(self) -> int:
        """The ranks ZeRO shards a stage's parameters over: dp x cp, or HSDP's shard group x cp."""
        return self.dp // self.dp_replicate * self.cp

    @property
    def grad_ranks(self) -> int:
        """The ranks that hold a stage's parameters: dp x cp."""
        return self.dp * self.cp

    @property
    def rank_micro_batch(self) -> float:
        """The sequences' worth of tokens a rank computes per micro-batch (planner.plan.Plan)."""
        return self.micro_batch / self.cp


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


# context parallelism is searched where each rank still keeps at least this many tokens of a
# sequence: Llama 3 405B's 131,072-token stage ran CP 16, 8,192 tokens a rank (Dubey et al. 2024,
# Table 4), its 8,192-token stage none; shorter sequences search without it unless --cp asks
MIN_CP_TOKENS = 8192


def cp_degrees(seq_len: int, document_mask: bool = False) -> list[int]:
    """The context-parallel degrees searched by default: 1, and the powers of two that leave a
    rank at least MIN_CP_TOKENS tokens; 1 alone under a document mask (planner.plan_checks)."""
    out, c = [1], 2
    if document_mask:
        return out
    while seq_len // c >= MIN_CP_TOKENS:
        out.append(c)
        c *= 2
    return out


def allowed_replicas(space: SearchSpace, dp: int, cp: int) -> list[int]:
    """The HSDP replica counts of `space` (None: every one) a dp degree admits
    (planner.hsdp.replica_counts, and 1), 2 and more only where ZeRO 1-3 is allowed."""
    valid = [1] + (replica_counts(dp, cp) if any(z >= 1 for z in space.zero) else [])
    return [r for r in valid if space.dp_replicate is None or r in space.dp_replicate]


def ep_degrees(model, dp_shard: int, zeros) -> list[int]:
    """The values of mesh.ep a configuration admits (planner.plan_checks) and the runtime runs
    (runtime.run_checks: ZeRO 1-3 on every stage, so only where `zeros` has one): 1, and the
    divisors of the experts that divide the shard group's dp coordinates (dp / dp_replicate)."""
    if model.moe is None or not any(z is None or z >= 1 for z in zeros):
        return [1]
    return [1] + [d for d in range(2, dp_shard + 1) if dp_shard % d == 0 and model.moe.experts % d == 0]


def configs(ctx, global_batch: int):
    m, c, sp_ = ctx.model, ctx.cluster, ctx.space
    world, dpn, total = c.world_size, c.devices_per_node, m.num_layers_total
    for tp in divisors(dpn):
        if any(n % tp for _, n in m.tp_split_sizes()) or (sp_.tp and tp not in sp_.tp) or world % tp:
            continue
        for pp, cp in itertools.product(divisors(world // tp), sp_.cp or cp_degrees(ctx.train.seq_len, ctx.train.document_mask)):
            if pp > total or (sp_.pp and pp not in sp_.pp) or world % (tp * pp * cp) \
                    or (cp > 1 and ctx.train.seq_len % (2 * cp)):  # CP splits a sequence into 2 cp chunks
                continue
            dp = world // (tp * pp * cp)
            if global_batch % dp or (sp_.dp and dp not in sp_.dp):
                continue
            for b in divisors(global_batch // dp):
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
                    elif s == "zbv":  # not with the sync deferred (planner.plan_checks)
                        if 2 * pp <= total and not ctx.train.defer_grad_sync:
                            scheds.append((s, 2))
                    elif s == "gpipe" or mbs >= pp:  # 1F1B needs a micro-batch per stage (planner.plan)
                        scheds.append((s, 1))
                sps = [x for x in sp_.sequence_parallel if tp > 1 or not x] or [False]
                # CP groups just outside TP: the next-nearest ranks (torchtitan's order)
                cand = [(*o[:-1], "cp", o[-1]) for o in sp_.orders] if cp > 1 else sp_.orders
                orders = distinct_orders(c, tp, pp, dp, cand, cp) if (pp > 1 and dp > 1) else cand[:1]
                zeros = [None] if sp_.zero_per_stage else (sp_.zero if dp * cp > 1 else sp_.zero[:1])
                recs = sp_.recompute if sp_.recompute_granularity == "plan" else [None]
                for (sched, v), sp, order, z, r, n in itertools.product(scheds, sps, orders, zeros, recs,
                                                                      allowed_replicas(sp_, dp, cp)):
                    if not (n == 1 or z is None or z >= 1):  # HSDP shards: ZeRO 1-3 (StageCosts.zeros)
                        continue
                    for ep in ep_degrees(m, dp // n, sp_.zero if z is None else (z,)):
                        if sp_.ep is None or ep in sp_.ep or m.moe is None:
                            yield Config(tp, pp, dp, b, mbs, sched, v, sp, tuple(order), z, r, cp, n, ep)


# the user's constraints on a search (SearchSpace fields), by the command-line option that sets them
CONSTRAINTS = {"tp": "--tp", "pp": "--pp", "dp": "--dp", "cp": "--cp", "micro_batch": "--micro-batch", "schedules": "--schedule",
               "virtual_stages": "--virtual-stages", "sequence_parallel": "--sequence-parallel",
               "dp_replicate": "--dp-replicate", "ep": "--ep"}


def no_configuration(ctx, global_batch: int) -> str:
    """Why no configuration exists: the one constraint that, lifted, would admit some (named, with
    the values that would work), else the problem itself."""
    m, c, space = ctx.model, ctx.cluster, ctx.space
    default = SearchSpace()
    where = f"{global_batch} sequences on {c.world_size} GPUs of {m.name}"
    given = {f: getattr(space, f) for f in CONSTRAINTS if getattr(space, f) != getattr(default, f)}
    if space.dp_replicate is not None and 1 not in space.dp_replicate and not any(z >= 1 for z in space.zero):
        return (f"--dp-replicate: {','.join(map(str, space.dp_replicate))} (HSDP) shards with ZeRO 1-3, which "
                f"--zero {','.join(map(str, space.zero))} leaves out; allow --zero 1, 2 or 3, or --dp-replicate 1")
    if space.ep is not None and 1 not in space.ep and m.moe is not None and not any(z >= 1 for z in space.zero):
        return (f"--ep: {','.join(map(str, space.ep))} spreads experts under ZeRO 1-3 (the runtime's), which "
                f"--zero {','.join(map(str, space.zero))} leaves out; allow --zero 1, 2 or 3, or --ep 1")
    # context parallelism and HSDP lifted: every count that could be asked for, not only the default's
    cps = tuple(d for d in divisors(c.world_size) if d == 1 or ctx.train.seq_len % (2 * d) == 0)
    lift = dict(vars(default), cp=cps, dp_replicate=None)
    show = lambda vals: ", ".join("on" if v is True else "off" if v is False else str(v) for v in vals)  # noqa: E731
    fixes = []  # each constraint that, lifted alone, admits configurations: with the values that work
    for field in given:
        lifted = copy.copy(ctx)  # the search's context (planner.search.Ctx) under the lifted space
        lifted.space = dataclasses.replace(space, **{field: lift[field]})
        cfgs = list(configs(lifted, global_batch))
        if cfgs:
            attr = {"schedules": "schedule", "virtual_stages": "v", "sequence_parallel": "sp"}.get(field, field)
            works = {getattr(cfg, attr) for cfg in cfgs if field != "virtual_stages" or cfg.v > 1}
            fixes.append((field, sorted(works)))
    if fixes:
        (field, ok), rest = fixes[0], fixes[1:]
        return (f"{CONSTRAINTS[field]}: {show(given[field] or ('all',))} admits no configuration of {where} with "
                f"the other choices; possible: {show(ok) or 'none'}"
                + "".join(f"; or {CONSTRAINTS[f]} {show(o) or 'all'} in place of {show(given[f] or ('all',))}"
                          for f, o in rest))
    if given:
        opts = " ".join(f"{CONSTRAINTS[f]} {','.join(str(v) for v in vals) if vals is not None else 'all'}"
                        for f, vals in given.items())
        return f"{opts}: together these admit no configuration of {where}; lift one of them"
    return (f"global_batch: {global_batch} sequences admit no configuration on {c.world_size} GPUs of {m.name} "
            f"(dp must divide it, tp the heads, and a data-parallel rank may run at most {MAX_MICRO_BATCHES} "
            f"micro-batches); use a multiple of the GPU count")
