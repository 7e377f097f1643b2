"""HSDP for the search's plans: each plan the search returns with ZeRO 1-3 on every stage and
dp >= 4 is priced again with its data-parallel ranks split into replicas of a shard group
(mesh.dp_replicate, every divisor of dp that leaves a shard group of at least 2), and replaced by
the fastest split that fits where that beats it (`trident search --dp-replicate` narrows the
counts; without 1 among them only split plans are kept).

By default a pass over the plans the search finds, not a dimension of the partition search
(planner.search): HSDP changes only the data-parallel collectives and the sharded states, never
the compute, so only a plan whose data-parallel communication is exposed can gain. `trident
search` passes its best HSDP_POOL flat plans at least, whatever --top asks, so a smaller --top
gives the same best plan. With `--dp-replicate COUNTS` (or `all`) the replica count is a dimension
of the search as well (planner.configs.allowed_replicas, SearchSpace.dp_replicate): layer splits,
ZeRO levels and micro-batches are then chosen under HSDP's own costs, which the pass cannot do,
and the pass then tries each plan found with the other counts allowed. Not the default: with
every count the search takes about 1.9x the time (3x on the largest benchmarks) and, not being
exhaustive, came out faster in 3 of 33 random problems and slower in 2
(benchmarks/search_variants.py --variant hsdp, session 43). Not every plan gains, and the one
that gains need not be among the first: on 4 nodes of 4 A100s sharing one 200 Gb/s NIC a node
(Llama 3 8B, 16 GPUs, global batch 64 at 8k tokens) the second flat plan of the default search
(tp1 pp2 dp8, interleaved 1F1B of 2 chunks, 9.842 s) splits into 2 replicas of 4 shards at 9.660
s, second behind a flat plan of 6 chunks a rank at 9.572 s that no split improves (session 43).
On the shipped eight-NIC profiles a large
flat group is not slower: NCCL's ring over the whole dp group carries 1/8 of the gradients across
each node's boundary per NIC, where the replicas' all-reduce carries a quarter (twice an eighth);
a small dp group that spans two nodes can be (Llama 3 70B on 16 DGX A100 nodes, tp4 pp8 dp4 under
ZeRO 1: 1.642 s as 2 replicas whose shard group is inside a node, 1.665 s flat), and so can a
measured profile whose large groups are slow (ClusterSpec by_group_size) or fewer NICs."""
from __future__ import annotations

import dataclasses

from planner.cost import estimate

HSDP_POOL = 5  # flat plans the search passes here at least (planner.search_cli): the default --top


def replica_counts(dp: int, cp: int = 1) -> list[int]:
    """The values of mesh.dp_replicate a dp degree admits besides 1 (planner.plan_checks: r divides
    dp and leaves a shard group of dp / r x cp ranks, at least 2)."""
    return [r for r in range(2, dp + 1) if dp % r == 0 and dp // r * cp >= 2]


def with_hsdp(results: list, cluster, memory_limit_bytes=None, model_profile=None, allowed=None) -> list:
    """`results` (planner.search.Found, best first), each plan replaced by its fastest split into
    `allowed` replica counts (None: every count; 1 is the flat plan) that fits, its own count
    included, dropped where none does; re-sorted. A plan the search found under HSDP is tried
    with the other counts too."""
    out = []
    for f in results:
        plan = f.plan
        best = f if allowed is None or plan.mesh.dp_replicate in allowed else None
        if all(st.zero >= 1 for st in plan.pipeline.stages):
            for r in [1] + replica_counts(plan.mesh.dp):
                if (allowed is not None and r not in allowed) or r == plan.mesh.dp_replicate:
                    continue
                if (plan.mesh.dp // r) % plan.mesh.ep:  # its experts spread inside each replica's shard group
                    continue
                p = dataclasses.replace(plan, mesh=dataclasses.replace(plan.mesh, dp_replicate=r)).validate()
                est = estimate(p, cluster, memory_limit_bytes=memory_limit_bytes, model_profile=model_profile)
                if est.fits and (best is None or est.step_time_s < best.estimate.step_time_s):
                    best = dataclasses.replace(f, plan=p, estimate=est)
        if best is not None:
            out.append(best)
    return sorted(out, key=lambda f: f.estimate.step_time_s)
