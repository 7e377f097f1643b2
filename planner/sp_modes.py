"""The search over both of sequence parallelism's saved-input modes (`trident search
--sp-saved-inputs either`): keeping the shard of what the column-parallel linears gather (less
memory, a second all-gather in the backward) or the gathered input (faster, more memory;
planner.plan.Training.sp_saved_inputs). The mode is one for a whole plan (the runtime reads it
from training), so the search runs once per mode and keeps the fastest plans of the two: every
configuration in the shard mode, and only the sequence-parallel ones again in the gathered mode
(the others do not depend on it), wanting only plans faster than the first search's K-th best.
Exact: the K best of the union are among the K best of each."""
from __future__ import annotations

import dataclasses

from planner.model import ConfigError

EITHER = "either"


def search_either(run, space, top: int = 1, **kw):
    """`run(space=..., top=..., sp_saved_inputs=..., **kw)` (planner.search.search or
    search_profiled with its model and cluster bound) in both modes, merged into one
    SearchResult: the `top` fastest plans, the counts summed."""
    res = run(space=space, top=top, sp_saved_inputs="shard", **kw)
    if True not in space.sequence_parallel:
        return res
    try:
        other = run(space=dataclasses.replace(space, sequence_parallel=(True,)), top=top,
                    sp_saved_inputs="gathered", cutoff_s=res.cutoff_s, **kw)
    except ConfigError:  # no sequence-parallel configuration (TP 1 only): the shard search stands
        return res
    merged = sorted(res.results + other.results, key=lambda f: f.estimate.step_time_s)[:top]
    res.cutoff_s = min(res.cutoff_s, other.cutoff_s)
    for field in ("configs", "pruned_memory", "expanded", "priced", "elapsed_s"):
        setattr(res, field, getattr(res, field) + getattr(other, field))
    res.results = merged
    return res
