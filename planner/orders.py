"""The order in which each pipeline rank runs its operations under each schedule, and what it
holds in flight as it does (planner.schedule plays the orders as events).

Orders follow Megatron-LM and torch.distributed.pipelining: 1F1B warms up with p-r-1 forwards
on rank r; interleaved 1F1B warms up with 2(p-r-1) + (v-1)p forwards and walks model chunks in
groups of p micro-batches (so it needs m to be a multiple of p). With v chunks per rank, chunk c
of rank r is stage c*p + r.

ZB-V (`zbv`; Qi et al. 2024, "Zero Bubble Pipeline Parallelism", section 6; torch's
ScheduleZBVZeroBubble) splits each backward in two: I, the gradient with respect to the stage's
input, which the previous stage waits for, and W, the gradient with respect to its weights, which
nobody waits for and fills the bubbles. Each rank holds two stages placed in a V: rank r runs
stage r and stage 2p-1-r, so the first and last stages share rank 0. Rank r warms up with
2(p-r)-1 forwards of its first stage, then r pairs of forwards (second stage, first stage), then
p-r rounds of forward, I and W of its second stage; in steady state it alternates F, I, W of its
first stage with F, I, W of its second; it cools down with r pairs of I (first, second stage),
then p-r pairs of I and W of its first stage, then the W it still owes, second stage first. A
stage's activations are held from its F to its W.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np


def rank_order(schedule: str, pp: int, virtual_stages: int, micro_batches: int, rank: int) -> list[tuple[str, int, int]]:
    """The (kind, stage, micro_batch) operations rank `rank` executes, in order."""
    p, v, m = pp, virtual_stages, micro_batches
    if p == 1:  # no pipeline: each micro-batch runs forward then backward (gradient accumulation)
        return [x for j in range(m) for x in (("F", 0, j), ("B", 0, j))]
    if schedule == "zbv":
        return list(_zbv_orders(p, m)[rank])
    if schedule == "gpipe":
        stages = [c * p + rank for c in range(v)]
        order = [("F", s, j) for s in stages for j in range(m)]
        return order + [("B", s, j) for s in reversed(stages) for j in range(m)]
    if schedule == "1f1b" and v == 1:
        warm = min(p - rank - 1, m)
        order = [("F", rank, j) for j in range(warm)]
        for i in range(m - warm):
            order += [("F", rank, warm + i), ("B", rank, i)]
        return order + [("B", rank, j) for j in range(m - warm, m)]
    if schedule != "interleaved-1f1b":
        raise ValueError(f"schedule {schedule!r} with {v} virtual stages")
    forward, chunk, mb = interleaved_sequence(p, v, m, rank)
    return [("F" if f else "B", c * p + rank, j) for f, c, j in zip(forward.tolist(), chunk.tolist(), mb.tolist())]


def interleaved_sequence(p: int, v: int, m: int, rank: int):
    """Interleaved 1F1B on rank `rank`: (is forward, chunk, micro-batch) arrays of its operations in
    order. The k-th forward runs chunk (k mod pv) div p of micro-batch (k div pv) p + k mod p and
    the k-th backward the chunks in reverse order (Narayanan et al. 2021, section 2.2): `warm`
    forwards, then a forward and a backward in turn, then the remaining backwards."""
    if m % p:
        raise ValueError(f"interleaved 1F1B needs micro_batches ({m}) to be a multiple of pp ({p})")
    total = m * v
    warm = min((p - rank - 1) * 2 + (v - 1) * p, total)
    k = np.arange(total)
    pos_f = np.where(k < warm, k, 2 * k - warm)
    pos_b = np.where(k < total - warm, warm + 2 * k + 1, total + k)
    forward = np.zeros(2 * total, dtype=bool)
    forward[pos_f] = True
    order = np.empty(2 * total, dtype=int)
    order[pos_f], order[pos_b] = k, k
    chunk = (order % (p * v)) // p
    return forward, np.where(forward, chunk, v - 1 - chunk), (order // (p * v)) * p + order % p


@lru_cache(maxsize=64)
def _zbv_orders(p: int, m: int) -> tuple:
    """_zbv_order of every rank, cached: the search asks for the same few many times."""
    return tuple(tuple(_zbv_order(p, m, r)) for r in range(p))


def _zbv_order(p: int, m: int, r: int) -> list[tuple[str, int, int]]:
    """Rank r's operations under ZB-V (module doc): played for max(m, 2p - 1) micro-batches, the
    pipeline's fill, then those of micro-batches that do not exist left out."""
    n = max(m, 2 * p - 1)
    first, second = r, 2 * p - 1 - r
    nxt = {("F", first): 0, ("F", second): 0, ("I", first): 0, ("I", second): 0, ("W", first): 0, ("W", second): 0}
    order = []

    def do(kind, stage):
        order.append((kind, stage, nxt[(kind, stage)]))
        nxt[(kind, stage)] += 1
    for _ in range(2 * (p - r) - 1):
        do("F", first)
    for _ in range(r):
        do("F", second)
        do("F", first)
    for _ in range(p - r):
        for kind in ("F", "I", "W"):
            do(kind, second)
    while nxt[("F", second)] < nxt[("F", first)] or nxt[("F", first)] < n:
        if nxt[("F", first)] < n:
            do("F", first)
        for stage in (first, second):
            if stage == second:
                do("F", second)
            do("I", stage)
            do("W", stage)
    for _ in range(r):
        do("I", first)
        do("I", second)
    for _ in range(p - r):
        do("I", first)
        do("W", first)
    for stage in (second, first):
        while nxt[("W", stage)] < nxt[("I", stage)]:
            do("W", stage)
    return [o for o in order if o[2] < m]


def peak_in_flight(schedule: str, pp: int, virtual_stages: int, micro_batches: int, rank: int,
                   weights: dict | None = None, split_weights: dict | None = None) -> float:
    """Most activation weight rank `rank` holds at once: the sum of weights[stage] over forwards
    whose backward has not run yet, or under a split backward whose W has not (a weight of 1 per
    stage counts micro-batches); plus, under a split backward, split_weights[stage] over the I
    whose W has not run (what the weight gradients start from)."""
    return peak_with_gradients(schedule, pp, virtual_stages, micro_batches, rank, weights, split_weights)[0]


def peak_with_gradients(schedule: str, pp: int, virtual_stages: int, micro_batches: int, rank: int,
                        weights: dict | None = None, split_weights: dict | None = None,
                        grads: dict | None = None) -> tuple[float, float]:
    """(activation weight, gradient weight) rank `rank` holds at the moment the two add up to the
    most: the activations as peak_in_flight counts them, beside grads[stage] of every stage whose
    first backward (under a split backward its first W, which computes the weight gradients) has
    begun: the runtime sets the gradients to None after every step (runtime/train.py), so a stage
    has none until then. A first backward is counted before it frees its micro-batch, with all
    the stage's gradients (at most what it holds then: planner.memory.first_backward_bytes)."""
    held = have = 0.0
    best = (0.0, 0.0)
    seen = set()
    for kind, s, _ in rank_order(schedule, pp, virtual_stages, micro_batches, rank):
        w = 1.0 if weights is None else weights[s]
        g = split_weights[s] if split_weights is not None else 0.0
        if grads is not None and kind in ("B", "W") and s not in seen:
            seen.add(s)
            have += grads[s]
            best = max(best, (held, have), key=sum)
        if kind == "F":
            held += w
        elif kind == "I":
            held += g
        elif kind == "W":
            held -= w + g
        else:
            held -= w
        best = max(best, (held, have), key=sum)
    return best
