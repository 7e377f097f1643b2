"""Timing the collectives the runtime issues, for `trident profile cluster` (runtime.profile).

Every rank creates the same groups (inside one node, and spanning nodes where there are several),
times each collective over a sweep of message sizes (median of repeats, the slowest rank's time,
two passes), and returns the points that runtime.profile fits to alpha-beta per tier.
"""
from __future__ import annotations

import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist

from planner.cluster import ring_factor
from runtime.device import current, scalar, timed

# torch 2.13 names the flat-tensor collectives *_single and deprecates the *_tensor names
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
SIZES = [4 * 4**i * 1024 for i in range(7)]  # 4 KiB .. 16 MiB
QUICK_SIZES = [4 * 4**i * 1024 for i in range(5)]  # 4 KiB .. 1 MiB
# GPUs: NCCL reaches its bus bandwidth only with messages of hundreds of MiB (nccl-tests sweeps to
# several GiB), and the gradients and gathers of a real model are that large
GPU_SIZES = [4 * 4**i * 1024 for i in range(10)]  # 4 KiB .. 1 GiB
GPU_QUICK_SIZES = [4 * 4**i * 1024 for i in range(0, 10, 3)]  # 4 KiB, 256 KiB, 16 MiB, 1 GiB


def sizes_for(device: torch.device, quick: bool) -> list:
    if device.type == "cuda":
        return GPU_QUICK_SIZES if quick else GPU_SIZES
    return QUICK_SIZES if quick else SIZES


class Progress:
    """A one-line text progress bar on rank 0 (stderr)."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.done, self.enabled, self.t0 = total, 0, enabled, time.perf_counter()

    def step(self, what: str) -> None:
        self.done += 1
        if self.enabled:
            n = int(30 * self.done / self.total)
            sys.stderr.write(f"\r[{'#' * n}{' ' * (30 - n)}] {self.done}/{self.total} "
                             f"{time.perf_counter() - self.t0:5.1f}s {what:<32}")
            if self.done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


def _median_time(fn, repeats: int, group=None) -> float:
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        times.append(timed(fn))
    return statistics.median(times)


def _max_over_ranks(x: float) -> float:
    t = scalar(x)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def mean_over_ranks(x: float) -> float:
    t = scalar(x)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def overlap_ratio(work, timer, buf) -> float:
    """`work`'s time by `timer` while an all-reduce of `buf` runs asynchronously, over its time
    alone (median of 5 each), at least 1, mean over ranks."""
    dist.barrier()
    alone = statistics.median(timer(work) for _ in range(5))
    dist.barrier()
    times = []
    for _ in range(5):
        h = dist.all_reduce(buf, async_op=True)
        times.append(timer(work))
        h.wait()
    return max(1.0, mean_over_ranks(statistics.median(times) / alone))


# ------------------------------------------------------------------ collectives
def _collective(op: str, nbytes: int, group, n: int, peer: int | None):
    """A closure running collective `op` on an S = nbytes buffer (the planner's S: the all-reduce
    buffer, the all-gather output, the reduce-scatter input)."""
    elems = max(n, nbytes // 4 // n * n)
    dev = current()
    ones = lambda k: torch.ones(k, device=dev)  # noqa: E731
    empty = lambda k: torch.empty(k, device=dev)  # noqa: E731
    if op == "all_reduce":
        buf = ones(elems)
        return lambda: dist.all_reduce(buf, group=group)
    if op == "all_gather":
        out, inp = empty(elems), ones(elems // n)
        return lambda: _ALL_GATHER(out, inp, group=group)
    if op == "reduce_scatter":
        out, inp = empty(elems // n), ones(elems)
        return lambda: _REDUCE_SCATTER(out, inp, group=group)
    if op == "all_to_all":
        out, inp = empty(elems), ones(elems)
        return lambda: dist.all_to_all_single(out, inp, group=group)
    buf = ones(elems)
    rank = dist.get_rank()

    def sendrecv():  # even members send to the odd ones
        if rank < peer:
            dist.send(buf, peer)
        else:
            dist.recv(buf, peer)
    return sendrecv


def group_layout(node_of_rank: list) -> dict:
    """The groups the sweep times: {"intra": {n: [groups]}, "cross": {n: [groups]}}.

    "intra": for every power-of-two n up to the smallest node's process count, each node's ranks
    cut into groups of n (on one node: the contiguous groups of every size up to the world).
    "cross" (only with more than one node): the ranks ordered node-minor (local index, then node),
    cut into groups of n for every power-of-two n <= world; each spans every node with the same
    number of members per node where the sizes divide (2 nodes x 2: {0,2},{1,3} and {0,1,2,3})."""
    world = len(node_of_rank)
    nodes = sorted(set(node_of_rank))
    members = {nd: [r for r in range(world) if node_of_rank[r] == nd] for nd in nodes}
    per_node = min(len(m) for m in members.values())
    out = {"intra": {}}
    for i in range(1, per_node.bit_length()):
        n = 2**i
        out["intra"][n] = [m[s:s + n] for nd in nodes for m in [members[nd]] for s in range(0, len(m) - len(m) % n, n)]
    if len(nodes) > 1:
        local = {r: members[node_of_rank[r]].index(r) for r in range(world)}
        interleaved = sorted(range(world), key=lambda r: (local[r], nodes.index(node_of_rank[r])))
        out["cross"] = {}
        for i in range(1, world.bit_length()):
            n = 2**i
            out["cross"][n] = [sorted(interleaved[s:s + n]) for s in range(0, world - world % n, n)]
    return out


def group_points(layout: dict) -> int:
    return sum(len(OPS) - (0 if 2 in by_n else 1) + (len(OPS) - 1) * (len(by_n) - 1) for by_n in layout.values())


def sweep(sizes, repeats: int, progress: Progress, layout: dict) -> dict:
    """{kind: {op: {n: [(factor * S, seconds, S), ...]}}} for every group size of each kind of
    group_layout (all groups of a size running at once)."""
    rank = dist.get_rank()
    groups = {}
    for kind, by_n in layout.items():  # every rank creates every group, in the same order
        for n, gs in by_n.items():
            for members in gs:
                g = dist.new_group(members)
                if rank in members:
                    groups[(kind, n)] = (g, members)
    out = {}
    for kind, by_n in layout.items():
        out[kind] = {}
        for op in OPS:
            out[kind][op] = {}
            for n in ([2] if op == "send_recv" else by_n):
                if n not in by_n:
                    continue
                pts = []
                for s in sizes * 2:  # two passes: a size disturbed in one pass is timed again later
                    g, members = groups.get((kind, n), (None, None))
                    if g is None:
                        fn = lambda: None  # noqa: E731
                    elif op == "send_recv":  # the lower member sends to the higher one
                        peer = members[1] if rank == members[0] else members[0]
                        fn = _collective(op, s, None, 2, peer)
                    else:
                        fn = _collective(op, s, g, n, None)
                    fn()  # warm-up (and connection setup)
                    reps = repeats if s >= 2**20 else 3 * repeats
                    t = _max_over_ranks(_median_time(fn, reps))
                    pts.append((ring_factor(op, n) * (s // 4 // n * n * 4 if op != "send_recv" else s), t, s))
                    progress.step(f"{kind} {op} n={n} {s // 1024} KiB")
                out[kind][op][n] = monotone([min(a, b, key=lambda p: p[1])
                                             for a, b in zip(pts[:len(sizes)], pts[len(sizes):])])
    return out


def monotone(pts: list) -> list:
    """A larger message cannot take less time than a smaller one: a size timed slower than a larger
    size was disturbed (other processes on the cores), so it takes the larger size's time."""
    out, best = [], float("inf")
    for x, t, s in reversed(pts):
        best = min(best, t)
        out.append((x, best, s))
    return out[::-1]


def node_key() -> str:
    """What tells this rank's node apart: the host name, and the node rank torchrun gives each
    node's agent (GROUP_RANK) where set, so that nodes sharing a host name (containers, network
    namespaces of one machine) still count as distinct nodes."""
    group = os.environ.get("GROUP_RANK")
    return socket.gethostname() + (f"/node{group}" if group is not None else "")


def per_node_of(members: list, node_of_rank: list) -> int:
    """The most members of `members` on one node."""
    nodes = [node_of_rank[r] for r in members]
    return max(nodes.count(x) for x in set(nodes))
