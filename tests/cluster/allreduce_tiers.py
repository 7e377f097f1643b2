"""torchrun worker: time an all-reduce inside a node and across nodes; rank 0 prints one JSON line.

    torchrun --nnodes 2 --nproc-per-node 2 ... tests/cluster/allreduce_tiers.py [--mbytes 16] [--reps 3]

With 2 nodes of 2 ranks (ranks 0,1 on node 0 and 2,3 on node 1), the intra-node groups are {0,1}
and {2,3} and the cross-node groups {0,2} and {1,3}; the pairs of each kind run at the same time,
as a real data-parallel step would. The line is `TIERS_JSON {...}` with the median seconds of each
kind and the bus bandwidth (2 (n-1)/n bytes / time) it implies.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def time_all_reduce(group, tensor: torch.Tensor, reps: int) -> list[float]:
    dist.all_reduce(tensor, group=group)  # warm-up: connects the pair
    times = []
    for _ in range(reps):
        dist.barrier()
        t = time.perf_counter()
        dist.all_reduce(tensor, group=group)
        times.append(time.perf_counter() - t)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mbytes", type=float, default=16)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    nodes = world // local
    # every rank creates every group, in the same order
    intra = [dist.new_group(list(range(n * local, (n + 1) * local))) for n in range(nodes)]
    cross = [dist.new_group(list(range(i, world, local))) for i in range(local)]
    my_intra, my_cross = intra[rank // local], cross[rank % local]
    tensor = torch.ones(int(args.mbytes * 2**20) // 4, dtype=torch.float32)
    t_intra = statistics.median(time_all_reduce(my_intra, tensor, args.reps))
    t_cross = statistics.median(time_all_reduce(my_cross, tensor, args.reps))
    if rank == 0:
        nbytes = tensor.numel() * tensor.element_size()

        def busbw(n, t):
            return 2 * (n - 1) / n * nbytes / t

        print("TIERS_JSON " + json.dumps({
            "bytes": nbytes, "world": world, "nodes": nodes, "ranks_per_node": local,
            "intra_s": t_intra, "cross_s": t_cross, "ratio": t_cross / t_intra,
            "intra_busbw_Bps": busbw(local, t_intra), "cross_busbw_Bps": busbw(nodes, t_cross),
            "gloo_socket_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
        }), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
