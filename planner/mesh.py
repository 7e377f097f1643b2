"""The device mesh of a plan: degrees and the order that maps a global rank to coordinates.

`order` lists the dimensions from outermost to innermost; a rank's coordinates are its digits in
that mixed radix (Megatron's RankGenerator idea). ["pp", "dp", "tp"] keeps each TP group on
consecutive ranks, so inside a node. Context parallelism (`cp` > 1) splits every sequence over cp
ranks and needs "cp" in the order; torchtitan's order puts it between dp and tp
(["pp", "dp", "cp", "tp"]), so a CP group is the next-nearest ranks after a TP group. With cp = 1
the order may leave it out (plans written before it existed do).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

MESH_DIMS = ("pp", "dp", "tp")  # always in the order; "cp" too when cp > 1


@dataclass
class Mesh:
    pp: int
    dp: int
    tp: int
    order: list = field(default_factory=lambda: ["pp", "dp", "tp"])  # outermost -> innermost
    # HSDP (torchtitan's data_parallel_replicate_degree): dp_replicate groups of dp / dp_replicate
    # consecutive dp coordinates; ZeRO shards within a group, the groups all-reduce their shards
    dp_replicate: int = 1
    # context parallelism: each sequence split over cp ranks, which hold the same parameters; they
    # add up gradients and share ZeRO shards with the data-parallel ranks (torchtitan's dp_shard_cp)
    cp: int = 1
    # expert parallelism (planner.moe): an MoE block's experts spread over ep consecutive dp
    # coordinates of a shard group, each rank holding experts / ep of them; ZeRO shards those over
    # the ranks that hold the same experts (expert_shard_group), and tokens reach their experts by
    # all-to-all within the EP group (expert_group)
    ep: int = 1

    @property
    def dp_shard(self) -> int:  # the dp coordinates ZeRO shards over: dp without HSDP
        return self.dp // self.dp_replicate

    @property
    def zero_shards(self) -> int:
        """The ranks ZeRO shards over and gradients add up over first: dp_shard x cp."""
        return self.dp_shard * self.cp

    @property
    def grad_ranks(self) -> int:
        """The ranks that hold one stage's parameters: dp x cp."""
        return self.dp * self.cp

    def size(self, dim: str) -> int:
        return getattr(self, dim)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    def coords(self, rank: int) -> dict:
        """Coordinates {pp, dp, cp, tp} of a global rank (cp 0 where the order leaves it out)."""
        out = {"cp": 0}
        for dim in reversed(self.order):
            n = self.size(dim)
            out[dim] = rank % n
            rank //= n
        return out

    def rank(self, **coords) -> int:
        """The global rank at `coords`; a dimension not given is at 0."""
        r = 0
        for dim in self.order:
            r = r * self.size(dim) + coords.get(dim, 0)
        return r

    def group(self, dim: str, **coords) -> range:
        """The ranks of the `dim` group through the rank at `coords` (`dim`'s own coordinate
        ignored): rank(**coords, dim=i) for each i, an arithmetic progression."""
        base = self.rank(**{**coords, dim: 0})
        if dim not in self.order:  # cp = 1 left out of the order
            return range(base, base + 1)
        stride = math.prod(self.size(d) for d in self.order[self.order.index(dim) + 1:])
        return range(base, base + stride * self.size(dim), stride)

    def shard_group(self, **coords):
        """The ranks through `coords` that ZeRO shards over and gradients reduce over: the dp
        shard group (all of dp without HSDP) times the CP group."""
        s = self.dp_shard
        first = coords.get("dp", 0) // s * s
        if self.cp == 1:
            return self.group("dp", **coords)[first:first + s]
        if self.order.index("cp") == self.order.index("dp") + 1:  # cp just inside dp: one progression
            step = self.group("cp", **coords).step
            base = self.rank(**{**coords, "dp": first, "cp": 0})
            return range(base, base + step * s * self.cp, step)
        return sorted(self.rank(**{**coords, "dp": d, "cp": c}) for d in range(first, first + s) for c in range(self.cp))

    def replicate_group(self, **coords) -> range:
        """The dp ranks through `coords` that hold the same shard (HSDP's replicas)."""
        return self.group("dp", **coords)[coords.get("dp", 0) % self.dp_shard::self.dp_shard]

    def expert_group(self, **coords) -> list[int]:
        """The ranks through `coords` among which an MoE block's experts are spread (ep of them):
        the dp coordinates of its block of ep, at the same cp and tp coordinates."""
        first = coords.get("dp", 0) // self.ep * self.ep
        return list(self.group("dp", **coords)[first:first + self.ep])

    def expert_shard_group(self, **coords) -> list[int]:
        """The ranks through `coords` that hold the same experts: the shard group's ranks whose dp
        coordinate is the same modulo ep (ZeRO shards the experts and reduces their gradients over
        them; all of the shard group without expert parallelism)."""
        if self.ep == 1:
            return list(self.shard_group(**coords))
        d = coords.get("dp", 0) % self.ep
        return [r for r in self.shard_group(**coords) if self.coords(r)["dp"] % self.ep == d]

    def groups(self, dim: str) -> list[list[int]]:
        """Every group of ranks that differ only in coordinate `dim` (e.g. the TP groups), by first rank."""
        return [list(self.group(dim, **c)) for c in map(self.coords, range(self.world_size)) if c[dim] == 0]
