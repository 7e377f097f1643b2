"""The options a stage's menu keeps (planner.menus, planner.stages): those no other option beats
in every time and in activations, within a class of options that replay alike."""
from __future__ import annotations

import numpy as np


def pareto(b, act, replay, more=()):
    """Indices not dominated in (b, act) within their replay class; with `more` (arrays of other
    times that differ among the options), in all of them (dominated by another no worse in every
    one, or the same and earlier)."""
    n = len(b)
    if n == 1:
        return np.zeros(1, dtype=int)
    if len(more):
        pts = np.stack([b, act, *more])
        no_worse = (pts[:, :, None] <= pts[:, None, :]).all(axis=0) & (replay[:, None] == replay[None, :])
        better = (pts[:, :, None] < pts[:, None, :]).any(axis=0) | np.tri(n, k=-1, dtype=bool).T
        return np.flatnonzero(~(no_worse & better).any(axis=0))
    order = np.lexsort((act, b, replay))  # by class, then b, then act
    r, a = replay[order], act[order]
    # one running minimum over all classes: each earlier class lifted above every later one
    cls = np.concatenate(([0], np.cumsum(r[1:] != r[:-1])))
    span = float(a.max() - a.min()) + 1.0
    lifted = a + (cls[-1] - cls) * span
    prev = np.empty(n)
    prev[0] = np.inf
    np.minimum.accumulate(lifted[:-1], out=prev[1:])
    return np.sort(order[lifted < prev])


def top_mode(cb, mode_act):
    """Per recompute combination (rows of counts per mode), the index among the modes present of
    the one holding the most activations per block (0 for a stage without blocks)."""
    present = np.where(cb > 0, np.asarray(mode_act)[None, :], -1.0)
    return np.where((cb > 0).any(axis=1), np.argmax(present, axis=1), 0)
