"""When a pipeline rank may let go of an input gradient it has sent: once it knows the receiving
rank has consumed it.

torch.distributed.pipelining's action runtime (interleaved 1F1B, ZB-V) waits for its sends only
at the end of the step, and the process groups keep each sent tensor until its work is waited
(gloo's work holds it, and ProcessGroupNCCL unstashes its references only in wait(): noted in
pytorch/pytorch#194120), so a rank would hold every input gradient of the step. The runtime
(runtime.pipeline) waits for a send once it has word that the receiver consumed it: the send's
transfer is then over, so the wait returns at once and cannot deadlock, on any backend.

Word travels only with the messages: a rank knows what the sender of a message it has consumed
knew when it sent it, and its own past. Vector clocks over the ranks' compute orders
(planner.orders.rank_order, the order torch runs) carry it; each send is posted right after the
compute action that produces it, and a receive is consumed by the compute action that needs it
(torch waits for it just before). Late in the step no message comes back to prove delivery, so a
rank still holds the sends of its last backwards until the step ends; planner.memory prices the
most a stage holds at once (unproven_sends).
"""
from __future__ import annotations

import heapq
from functools import lru_cache

import numpy as np

from planner.plan import stage_rank
from planner.orders import rank_order


def _message(kind: str, s: int, n_stages: int, rank_of, r: int):
    """(receiving stage, receiving rank, is a backward send) of the message action (kind, s) on
    rank r sends another rank, or None."""
    if kind == "F" and s < n_stages - 1 and rank_of(s + 1) != r:
        return s + 1, rank_of(s + 1), False
    if kind in ("B", "I") and s > 0 and rank_of(s - 1) != r:
        return s - 1, rank_of(s - 1), True
    return None


def _awaited(kind: str, s: int, n_stages: int, rank_of, r: int):
    """(kind "F"/"B", receiving stage) of the message action (kind, s) on rank r waits for from
    another rank (the micro-batch is the action's), or None."""
    if kind == "F" and s > 0 and rank_of(s - 1) != r:
        return "F", s
    if kind in ("B", "I") and s < n_stages - 1 and rank_of(s + 1) != r:
        return "B", s
    return None


def delivery_proofs(orders: dict, rank_of, n_stages: int) -> dict:
    """{rank: {(kind, stage, micro-batch) of a compute action: [(stage, micro-batch) of the
    backward sends it proves delivered]}}, from each rank's compute actions in order (`orders`:
    rank -> [(kind, stage, micro-batch)], kinds F, B, I, W) and the rank of each stage. A rank
    learns, by the time an action starts (its received input consumed), every action the senders
    of what it has consumed had run; a backward send is delivered once its receiver has run the
    action that consumes it. Sends no action proves are left to the end of the step."""
    ranks = sorted(orders)
    col = {r: k for k, r in enumerate(ranks)}
    where = {r: {(("B" if a[0] in ("B", "I") else a[0]), a[1], a[2]): i for i, a in enumerate(orders[r])}
             for r in ranks}
    # per rank, per action: the message it waits for, the message it sends, and for a backward
    # send (peer column, the peer's action that consumes it): (kind "F"/"B", receiving stage, micro-batch)
    table = {}
    for r in ranks:
        table[r] = rows = []
        for kind, s, j in orders[r]:
            need, msg = _awaited(kind, s, n_stages, rank_of, r), _message(kind, s, n_stages, rank_of, r)
            sends = None if msg is None else ("B" if msg[2] else "F", msg[0], j)
            back = (col[msg[1]], where[msg[1]][sends], (s, j)) if msg is not None and msg[2] else None
            rows.append((None if need is None else (*need, j), sends, back))
    clock = {r: np.full(len(ranks), -1, dtype=np.int64) for r in ranks}  # numpy: pp 32 has 32 entries
    stamps: dict = {}  # message -> the sender's clock when it sent it
    # per rank, per consumer's column, a heap of its sends not yet proven: (the consumer's action
    # index, the send's number on this rank, (stage, micro-batch)); the earliest consumer first
    pending: dict = {r: {} for r in ranks}
    sent = dict.fromkeys(ranks, 0)
    proofs = {r: {} for r in ranks}
    nxt = dict.fromkeys(ranks, 0)
    while any(nxt[r] < len(orders[r]) for r in ranks):
        moved = False
        for r in ranks:
            i, rows, mine, heaps = nxt[r], table[r], clock[r], pending[r]
            while i < len(rows):
                need, sends, back = rows[i]
                if need is not None:
                    got = stamps.get(need)
                    if got is None:
                        break
                    np.maximum(mine, got, out=mine)
                mine[col[r]] = i
                known = []  # the sends whose consumer's action this rank now knows has run
                for c, heap in heaps.items():
                    while heap and heap[0][0] <= mine[c]:
                        known.append(heapq.heappop(heap)[1:])
                if known:
                    proofs[r][orders[r][i]] = [x for _, x in sorted(known)]  # in the order sent
                if sends is not None:
                    stamps[sends] = mine.copy()
                    if back is not None:
                        heapq.heappush(heaps.setdefault(back[0], []), (back[1], sent[r], back[2]))
                        sent[r] += 1
                i += 1
                moved = True
            nxt[r] = i
        if not moved:
            raise ValueError("the compute orders wait on each other: no rank can run its next action")
    return proofs


def held_sends(order: list, proofs: dict, n_stages: int, rank_of, r: int) -> tuple[dict, dict]:
    """({stage: most of its backward sends rank r holds at once}, {stage: those it holds when the
    rank holds the most of all its stages'}), sent and not yet proven delivered, counted at each
    action's start as the runtime lets them go."""
    held: dict = {}
    most: dict = {}
    peak: dict = {}
    for kind, s, j in order:
        for stage, _ in proofs.get((kind, s, j), ()):
            held[stage] -= 1
        msg = _message(kind, s, n_stages, rank_of, r)
        if msg is not None and msg[2]:
            held[s] = held.get(s, 0) + 1
            most[s] = max(most.get(s, 0), held[s])
            if sum(held.values()) > sum(peak.values()):
                peak = dict(held)
    return most, peak


# micro-batches (in units of pp) past which what each stage holds no longer changes: the steady
# state repeats and the last backwards are the same few. Each stage's most is constant from 1 x pp
# on for both schedules, and so are the counts at a rank's worst moment from 2 x pp on: pp 2 to 8
# up to 24 x pp (tests/test_sends.py), and pp 2 to 32 at 2, 3 and 4 x pp, ZB-V's every count from
# 2 x pp to 4 x pp for pp 2 to 16 (session 40; 4 x pp before, whose proofs took 2.4 s of the
# gpt3-175b/1024 search)
STEADY_ROUNDS = 2


def unproven_sends(schedule: str, pp: int, virtual_stages: int, micro_batches: int, together: bool = True) -> tuple:
    """Per stage, the input gradients its rank holds sent and not yet proven delivered
    (delivery_proofs over planner.orders.rank_order) under `schedule`: `together`, those it holds
    when its rank holds the most of all its stages' (the rank's worst moment where every stage's
    message is the same size: a third of the stages' own maxima summed on interleaved pp 16 with
    6 chunks), else each stage's own most. Past STEADY_ROUNDS x pp micro-batches, as at that many
    (the search prices thousands of configurations)."""
    return _unproven(schedule, pp, virtual_stages, min(micro_batches, STEADY_ROUNDS * pp))[0 if together else 1]


@lru_cache(maxsize=1024)
def _unproven(schedule: str, pp: int, virtual_stages: int, micro_batches: int) -> tuple[tuple, tuple]:
    """(per stage at its rank's worst moment, per stage at its own), unproven_sends's two."""
    n = pp * virtual_stages
    orders = {r: rank_order(schedule, pp, virtual_stages, micro_batches, r) for r in range(pp)}
    rank_of = [stage_rank(schedule, pp, s) for s in range(n)].__getitem__
    proofs = delivery_proofs(orders, rank_of, n)
    most: dict = {}
    peak: dict = {}
    for r in range(pp):
        own, together = held_sends(orders[r], proofs[r], n, rank_of, r)
        most.update(own)
        peak.update(together)
    return tuple(peak.get(s, 0) for s in range(n)), tuple(most.get(s, 0) for s in range(n))
