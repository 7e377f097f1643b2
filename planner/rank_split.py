"""Layer splits that balance pipeline ranks of several chunks (interleaved 1F1B, ZB-V), for the
search's full sweep (planner.partition).

The partition's dynamic programme balances stages: its min-max bounds the costliest stage, and a
polish moves one block at a time between neighbouring stages. A rank's work is the sum of its
chunks, and where one rank holds a block more than the others, moving it only hands it to another
rank, so neither reaches the balanced split: Llama 2 13B on 8 nodes of 8 A100s with one 200 Gb/s
NIC each (global batch 128, 2k tokens), ZB-V on pp 8, came out at 2.58 s with rank 0 holding 6
blocks beside ranks of 5, where the balanced split takes 2.37 s (session 43).
"""
from __future__ import annotations

import math

import numpy as np

TOL = 1e-9


def rank_split(cost, blocks: int, stages_of, cap: float = math.inf):
    """The blocks of each stage (a list, by stage) that make the busiest rank's cost least: a
    rank's cost is the sum of its stages' cost[s, k] (the cheapest option of k blocks, inf where
    none fits), `stages_of[r]` its stages. No stage may cost more than `cap` (balanced ranks of
    uneven chunks fill and drain the pipeline slower: the search passes its first bottlenecks).
    Beyond each rank's least blocks the rest go where they add least under that threshold. None
    where no split fits, or where a rank's least cost does not grow with its blocks (then the
    stage-level splits stand).

    Per rank (ranks alike computed once) the least cost of n blocks over its chunks, a min-plus
    convolution; the busiest rank's least cost is then the least threshold under which the ranks'
    most blocks add up to `blocks`."""
    L, INF = blocks, math.inf
    cost = np.where(cost <= cap * (1 + TOL), cost, INF)
    n = np.arange(L + 1)
    memo, ranks = {}, []
    for stages in stages_of:
        rows = cost[stages]
        key = rows.tobytes()
        if key not in memo:
            R, picks = np.where(n == 0, 0.0, INF), []  # the least cost of n blocks over its chunks so far
            for row in rows:
                ks = np.flatnonzero(np.isfinite(row))
                before = n[None, :] - ks[:, None]  # [k, n]: blocks of the chunks before
                cand = np.where(before >= 0, R[before.clip(0)] + row[ks][:, None], INF)
                picks.append(ks[cand.argmin(axis=0)] if len(ks) else np.zeros(L + 1, dtype=int))
                R = cand.min(axis=0) if len(ks) else np.full(L + 1, INF)
            memo[key] = R, picks
        ranks.append(memo[key])
    R = np.array([r for r, _ in ranks])  # (ranks, n)
    ok = np.isfinite(R)
    if not ok.any(axis=1).all():
        return None
    lo, hi = ok.argmax(axis=1), L - ok[:, ::-1].argmax(axis=1)
    inside = (n[None, :] >= lo[:, None]) & (n[None, :] <= hi[:, None])
    steps = inside[:, :-1] & inside[:, 1:]
    if lo.sum() > L or hi.sum() < L or not ok[inside].all() or \
            (np.diff(np.where(inside, R, 0.0), axis=1)[steps] < 0).any():
        return None  # no split, or a rank's cost not growing with its blocks
    ramp = np.where(n[None, :] < lo[:, None], -INF, R)  # nondecreasing per rank
    idx = np.arange(len(R))
    values = np.unique(R[inside])
    values = values[values >= R[idx, lo].max()]  # every rank holds its least blocks
    most = np.array([np.searchsorted(row, values, side="right") - 1 for row in ramp])  # (ranks, values)
    i = int(np.searchsorted(most.sum(axis=0), L))  # the least threshold that places every block
    if i == len(values):
        return None
    # each rank its most blocks under the threshold below, then the rest to the ranks whose next
    # block adds least, as far as the threshold allows
    base = np.maximum(most[:, i - 1], lo) if i else lo
    allow = np.maximum(most[:, i] - base, 0)
    order = np.argsort(R[idx, np.minimum(base + 1, L)], kind="stable")
    before = np.cumsum(allow[order]) - allow[order]
    got = base.copy()
    got[order] += np.clip(L - base.sum() - before, 0, allow[order])
    sizes = [0] * sum(len(st) for st in stages_of)
    for (_, picks), stages, m in zip(ranks, stages_of, got):
        m = int(m)
        for st, arg in zip(stages[::-1], picks[::-1]):
            sizes[st] = int(arg[m])
            m -= sizes[st]
    return sizes
