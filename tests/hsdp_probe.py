"""Run by tests/test_hsdp.py in several ranks: runtime.train's main with its arguments, counting the
all-reduces each plan issues on each process group. Each rank writes {plan: {"ranks of the group":
calls}} to COUNTS_DIR/rank<r>.json.

    python tests/forkrun.py N tests.hsdp_probe COUNTS_DIR --plan ... --steps ... --out ...
    (or python -m torch.distributed.run ... tests/hsdp_probe.py COUNTS_DIR ...)"""
import json
import os
import sys
from collections import Counter
from pathlib import Path

import torch.distributed as dist

import runtime.train as rt


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out, argv = Path(argv[0]), argv[1:]
    counts: dict[str, Counter] = {}
    current = [""]
    all_reduce, train = dist.all_reduce, rt.train

    def counting_all_reduce(tensor, *args, group=None, **kwargs):
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        counts.setdefault(current[0], Counter())[",".join(map(str, ranks))] += 1
        return all_reduce(tensor, *args, group=group, **kwargs)

    def counting_train(plan, path, *args, **kwargs):
        current[0] = Path(path).stem
        return train(plan, path, *args, **kwargs)

    dist.all_reduce, rt.train = counting_all_reduce, counting_train
    rc = rt.main(argv)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(counts))
    return rc


if __name__ == "__main__":
    sys.exit(main())
