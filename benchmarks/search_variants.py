"""The default search against a variant of it, on random problems.

    python benchmarks/search_variants.py --variant hsdp|rank-splits|quick-rank-split|thorough [--seed N]
        [--problems N] [--one-plan]

Each problem (a model, a cluster, a number of nodes, a global batch and a sequence length; the
clusters are shipped profiles and profiles derived from them with fewer or slower NICs, as
`trident cluster derive` writes them, planner.cluster_cli.derive) is searched twice back to back
in this process, as `trident search` runs it (HSDP's pool of 5 plans, each then split into
replicas where that is faster, planner.hsdp.with_hsdp):

- `hsdp`: the default (flat plans found, split afterwards) against `--dp-replicate all` (the
  replica count a dimension of the search, planner.configs.allowed_replicas);
- `rank-splits`: the search without the full sweep's rank-balanced splits of ranks of several
  chunks (SearchSpace.rank_splits False, as before session 43) against the default;
- `quick-rank-split`: the quick pass without the rank-balanced split at the best bottleneck
  (SearchSpace.quick_rank_split False, as before session 56) against the default;
- `thorough`: the default against `--thorough` (SearchSpace.thorough: every configuration its
  bound cannot rule out split in full).

`--one-plan`: each search asked for one flat plan alone, as `trident search --dp-replicate 1 --top 1`
runs it (the quick key prunes more than with HSDP's pool).

The table gives each one's best step time and mesh (tp, pp, replicas x shards, schedule), their
ratio (first / second: above 1, the second is faster) and the two wall times; then how many
problems differ, and the ratio of the total times. The second's space holds the first's plans,
but the search is not exhaustive (planner.search's quick key), so a ratio below 1 can happen: it
is printed as measured. No target.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODELS = ("llama2-7b", "llama3-8b", "llama2-13b", "llama3-70b", "llama2-70b", "gpt3-175b")
CLUSTERS = {  # name: (base, derive's keyword arguments; None: the shipped profile)
    "a100-1nic": ("dgx-a100-80gb", dict(nics_per_node=1)),
    "a100x4-1nic": ("dgx-a100-80gb", dict(devices_per_node=4, nics_per_node=1)),
    "h100x4-200g": ("dgx-h100-80gb", dict(devices_per_node=4, nic_gbps=200)),
    "h100-1nic-100g": ("dgx-h100-80gb", dict(nics_per_node=1, nic_gbps=100)),
    "h100-2nic": ("dgx-h100-80gb", dict(nics_per_node=2)),
    "dgx-h100-80gb": ("dgx-h100-80gb", None),
    "dgx-a100-80gb": ("dgx-a100-80gb", None),
    "hgx-h200-141gb": ("hgx-h200-141gb", None),
}


def cluster(name: str, nodes: int):
    from planner.cluster import PROFILE_DIR, cluster_from_dict, load_cluster, read_profile
    from planner.cluster_cli import derive
    base, changes = CLUSTERS[name]
    if changes is None:
        return load_cluster(base, nodes=nodes)
    path, data, digest = read_profile(base, PROFILE_DIR, "--cluster")
    derived, _ = derive(data, path.stem, digest, name, **changes)
    return cluster_from_dict(derived, source=name).with_nodes(nodes)


def best_of(model, cl, space, one_plan=False, **kw):
    """(the best plan's Found or None, seconds), as `trident search` finds it in `space` (with
    `one_plan`, as `--dp-replicate 1 --top 1`)."""
    from planner.hsdp import HSDP_POOL, with_hsdp
    from planner.model import ConfigError
    from planner.search import search
    t = time.perf_counter()
    try:
        if one_plan:
            found = search(model, cl, top=1, space=space, **kw).results
        else:
            found = with_hsdp(search(model, cl, top=HSDP_POOL, space=space, **kw).results, cl)
    except ConfigError:
        found = []
    return (found[0] if found else None), time.perf_counter() - t


def spaces(variant: str):
    from planner.search import SearchSpace
    if variant == "hsdp":
        return SearchSpace(), SearchSpace(dp_replicate=None)
    if variant == "quick-rank-split":
        return SearchSpace(quick_rank_split=False), SearchSpace()
    if variant == "thorough":
        return SearchSpace(), SearchSpace(thorough=True)
    return SearchSpace(rank_splits=False), SearchSpace()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", choices=("hsdp", "rank-splits", "quick-rank-split", "thorough"), required=True)
    ap.add_argument("--one-plan", action="store_true", help="one flat plan a search (--dp-replicate 1 --top 1)")
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--problems", type=int, default=40)
    args = ap.parse_args(argv)
    from planner.model_files import load_model
    rng = random.Random(args.seed)
    first_space, second_space = spaces(args.variant)
    ratios, times = [], [0.0, 0.0]
    mesh = lambda f: "-" if f is None else (  # noqa: E731
        f"tp{f.plan.mesh.tp} pp{f.plan.mesh.pp} {f.plan.mesh.dp_replicate}x{f.plan.mesh.dp_shard} "
        f"{f.plan.pipeline.schedule}")
    step = lambda f: "no fit" if f is None else f"{f.estimate.step_time_s:.4g}"  # noqa: E731
    print("model  cluster  nodes  global_batch  seq  first_s  first_plan  second_s  second_plan  ratio  t_first  t_second")
    for _ in range(args.problems):
        m, c = rng.choice(MODELS), rng.choice(sorted(CLUSTERS))
        nodes, gb, seq = rng.choice([1, 2, 3, 4, 8, 16]), rng.choice([32, 64, 128, 256, 512]), rng.choice([2048, 4096])
        model, cl = load_model(m), cluster(c, nodes)
        (a, ta), (b, tb) = (best_of(model, cl, space, one_plan=args.one_plan, global_batch=gb, seq_len=seq)
                            for space in (first_space, second_space))
        ratio = a.estimate.step_time_s / b.estimate.step_time_s if a and b else None
        if ratio is not None:
            ratios.append(ratio)
            times[0] += ta
            times[1] += tb
        print(m, c, nodes, gb, seq, step(a), mesh(a), step(b), mesh(b), "-" if ratio is None else f"{ratio:.4f}",
              f"{ta:.2f}", f"{tb:.2f}", sep="  ", flush=True)
    faster = [r for r in ratios if r > 1 + 1e-9]
    slower = [r for r in ratios if r < 1 - 1e-9]
    span = lambda rs: f" ({min(rs) - 1:+.2%} to {max(rs) - 1:+.2%})" if rs else ""  # noqa: E731
    print(f"\n{len(ratios)} of {args.problems} problems have a plan both ways; the second is faster in "
          f"{len(faster)}{span(faster)}, slower in {len(slower)}{span(slower)}; total search time "
          f"{times[1] / times[0]:.2f}x the first's" if ratios else "\nno problem has a plan")
    return 0


if __name__ == "__main__":
    sys.exit(main())
