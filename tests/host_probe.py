"""Run by tests/test_host_share.py under torchrun (2 gloo processes): runtime.host_share's
reading of other work on the cores, first as the machine is, then with rank 0 running a busy
loop in another process beside the sleeping ranks; then runtime.host_share.HostWatch on clocks
that differ by rank. Prints one JSON line from rank 0: the cores busy with other work each time,
host_warning's warning the second time, and what each rank's HostWatch measured when."""
import json
import subprocess
import sys

import torch.distributed as dist

import runtime.host_share as hs
from runtime.host_share import HostWatch, host_warning, other_load


def main() -> None:
    dist.init_process_group("gloo")
    out = {"idle_cores": other_load()}
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if dist.get_rank() == 0 else None
    try:
        dist.barrier()
        out.update(busy_cores=other_load(), busy_warning=host_warning())
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    out["watch"] = watch()
    if dist.get_rank() == 0:
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()


def watch() -> list:
    """Every rank's log of a HostWatch's measurements over two plans 4 s apart and a third 40 s
    later; rank 1's clock runs 100 s ahead of rank 0's, which decides for both."""
    now, log = [0.0], []
    for name in ("other_load", "compute_slots"):
        real = getattr(hs, name)
        setattr(hs, name, lambda *a, _real=real, _name=name: log.append([_name, now[0]]) or _real(*a))
    w = HostWatch(True, dist.get_world_size(), clock=lambda: now[0] + 100 * dist.get_rank())
    for start in (0.0, 5.0, 45.0):
        now[0] = start
        before, slots = w.before()
        assert before is not None and 1.0 <= slots <= 2.0
        now[0] = start + 1.0
        w.after()
    logs = [None] * dist.get_world_size()
    dist.all_gather_object(logs, log)
    return logs


if __name__ == "__main__":
    main()
