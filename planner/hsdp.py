"""HSDP for the search's plans: each plan the search returns with ZeRO 1-3 on every stage and
dp >= 4 is priced again with its data-parallel ranks split into replicas of a shard group
(mesh.dp_replicate, every divisor of dp that leaves a shard group of at least 2), and replaced by
the fastest split that fits where that beats it (`trident search --dp-replicate` narrows the
counts; without 1 among them only split plans are kept).

A pass over the plans the search finds, not a dimension of the partition search
(planner.search): HSDP changes only the data-parallel collectives and the sharded states, never
the compute, so only a plan whose data-parallel communication is exposed can gain. `trident
search` passes its best HSDP_POOL flat plans at least, whatever --top asks, so a smaller --top
gives the same best plan. Not every plan gains, and the one that gains need not be among the
first: on 4 nodes of 4 A100s sharing one 200 Gb/s NIC a node (Llama 3 8B, 16 GPUs, global batch
64 at 8k tokens) the fifth flat plan of the default search (tp2 pp2 dp4, interleaved 1F1B of 2
chunks, 9.941 s) splits into 2 replicas of 2 shards at 9.820 s, second behind a flat tp1 pp2 dp8
plan at 9.572 s that no split improves (session 42). On the
shipped eight-NIC profiles the flat group is not slower in any case tried: NCCL's ring over the
whole dp group carries 1/8 of the gradients across each node's boundary per NIC, where the
replicas' all-reduce carries a quarter (twice an eighth); a measured profile whose large groups
are slow (ClusterSpec by_group_size) or fewer NICs can make HSDP the faster plan."""
from __future__ import annotations

import dataclasses

from planner.cost import estimate

HSDP_POOL = 5  # flat plans the search passes here at least (planner.search_cli): the default --top


def replica_counts(dp: int) -> list[int]:
    """The values of mesh.dp_replicate a dp degree admits besides 1."""
    return [r for r in range(2, dp // 2 + 1) if dp % r == 0]


def with_hsdp(results: list, cluster, memory_limit_bytes=None, model_profile=None, allowed=None) -> list:
    """`results` (planner.search.Found, best first), each plan replaced by its fastest split into
    `allowed` replica counts (None: every count; 1 is the flat plan itself) that fits, dropped
    where none does; re-sorted."""
    out = []
    for f in results:
        plan = f.plan
        best = f if allowed is None or 1 in allowed else None
        if all(st.zero >= 1 for st in plan.pipeline.stages):
            for r in replica_counts(plan.mesh.dp):
                if allowed is not None and r not in allowed:
                    continue
                p = dataclasses.replace(plan, mesh=dataclasses.replace(plan.mesh, dp_replicate=r)).validate()
                est = estimate(p, cluster, memory_limit_bytes=memory_limit_bytes, model_profile=model_profile)
                if est.fits and (best is None or est.step_time_s < best.estimate.step_time_s):
                    best = dataclasses.replace(f, plan=p, estimate=est)
        if best is not None:
            out.append(best)
    return sorted(out, key=lambda f: f.estimate.step_time_s)
