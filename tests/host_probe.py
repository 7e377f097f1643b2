"""Run by tests/test_host_share.py under torchrun (2 gloo processes): runtime.host_share's
reading of other work on the cores, first as the machine is, then with rank 0 running a busy
loop in another process beside the sleeping ranks. Prints one JSON line from rank 0: the cores
busy with other work each time, and host_warning's warning the second time."""
import json
import subprocess
import sys

import torch.distributed as dist

from runtime.host_share import host_warning, other_load


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
    if dist.get_rank() == 0:
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
