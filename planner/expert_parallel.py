"""Expert parallelism for the search's plans of mixture-of-experts models: each plan found is
priced again with its experts spread over every expert-parallel degree the plan admits (mesh.ep:
a divisor of the experts and of the data-parallel shard group, planner.moe) and the runtime runs
(runtime.moe: ZeRO 1-3), and replaced by the fastest that
fits where that beats it (`trident search --ep` narrows the degrees).

A pass over the plans found, as HSDP's (planner.hsdp), not a dimension of the partition search:
expert parallelism changes no layer's compute, only the experts' memory (experts / ep of them
a rank), their data-parallel collectives (over dp / ep ranks) and the all-to-alls it adds. So a
plan that fits only with the experts spread, or whose layer split would move with their memory,
is not found: the search's plans are chosen without it."""
from __future__ import annotations

import dataclasses

from planner.cost import estimate


def ep_degrees(plan) -> list[int]:
    """The values of mesh.ep besides 1 that a plan admits (planner.plan_checks) and the runtime runs
    (runtime.run_checks: ZeRO 1-3 on every stage): divisors of the experts and of the shard group's
    dp coordinates (dp / dp_replicate under HSDP)."""
    m, mesh = plan.model, plan.mesh
    if m.moe is None or min(st.zero for st in plan.pipeline.stages) == 0:
        return []
    return [d for d in range(2, mesh.dp_shard + 1) if mesh.dp_shard % d == 0 and m.moe.experts % d == 0]


def with_ep(results: list, cluster, memory_limit_bytes=None, allowed=None) -> list:
    """`results` (planner.search.Found, best first), each plan replaced by its fastest variant over
    the `allowed` expert-parallel degrees (None: every degree; 1 is the plan as found) that fits,
    dropped where none does; re-sorted. Plans of dense models pass as they are."""
    out = []
    for f in results:
        plan = f.plan
        if plan.model.moe is None:
            out.append(f)
            continue
        best = f if allowed is None or plan.mesh.ep in allowed else None
        for ep in [1] + ep_degrees(plan):
            if (allowed is not None and ep not in allowed) or ep == plan.mesh.ep:
                continue
            p = dataclasses.replace(plan, mesh=dataclasses.replace(plan.mesh, ep=ep)).validate()
            est = estimate(p, cluster, memory_limit_bytes=memory_limit_bytes)
            if est.fits and (best is None or est.step_time_s < best.estimate.step_time_s):
                best = dataclasses.replace(f, plan=p, estimate=est)
        if best is not None:
            out.append(best)
    return sorted(out, key=lambda f: f.estimate.step_time_s)
