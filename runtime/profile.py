"""torchrun entry: measure this cluster and a model, and write profiles the planner reads.

    torchrun --nproc-per-node N -m runtime.profile cluster -o profiles/hardware/NAME.json [--quick]
    torchrun --nproc-per-node N -m runtime.profile model --model tiny --cluster-profile P --seq-len 32 \
        [--micro-batches 1,2,4] [--tp 1,2,4] -o profiles/models/NAME.json

`cluster` writes a ClusterSpec JSON (planner.cluster reads it) with "kind": "measured":
- device: the matmul rate (fp32; on CPU "peak" is the best rate of a large square matmul, and
  matmul_efficiency is the median rate at transformer-like shapes over that peak), memory
  bandwidth (a large copy; recorded as achieved, efficiency 1) and that of the kernels converting
  dtypes (runtime.profile_gpu.conversion_bandwidth), capacity (/proc/meminfo or
  sysconf, divided among the processes of a node), all measured on every rank at once;
- for all_reduce, all_gather, reduce_scatter, all_to_all and send_recv and every power-of-two
  group size n <= N (all groups of that size running at once), the median time of a message-size
  sweep, fitted by least squares to t = alpha + factor(n) * S / busbw (planner.cluster) and
  stored under `by_group_size`, with piecewise fits by message size under its `segments`; the
  per-tier default is the largest group's fit;
- topology.node_of_rank from the hostnames and torchrun's node rank (GROUP_RANK), so that nodes
  sharing a host name (network namespaces of one machine) are told apart; the intra_node tier is
  fitted on groups inside a node, the inter_node tier, with more than one node, on groups spanning
  the nodes (group_layout; its busbw per device, as planner.cluster prices it); on one node the
  inter_node tier copies the intra-node fit (said so in `sources`);
- overlap_slowdown: matmul time while a large all-reduce runs in the background over matmul
  time alone.
- compute_slots: how many ranks compute at full speed at once (processes sharing CPU cores:
  the cores; GPUs: the world size); the schedule simulator shares them (planner.schedule).
`model` is in runtime/profile_model.py (the format is in planner/model_profile.py).
"""
from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from planner.model_profile import fit_alpha_beta, fit_segments
from planner.args import OneLineParser, profile_name
from planner.profile_checks import decimal
from runtime.comm_sweep import (OPS, Progress, mean_over_ranks, group_layout, group_points, node_key, overlap_ratio,
                                per_node_of, sizes_for, sweep)
from runtime.device import current
from runtime.host_share import _timed, compute_slots, host_warning
from runtime.oneline import fail
from runtime.profile_gpu import conversion_bandwidth

# ------------------------------------------------------------------ device
def matmul_rate(m: int, n: int, k: int, budget_s: float = 0.15, dtype=torch.float32) -> float:
    """Best FLOP/s of an (m x k) @ (k x n) product on the CPU over a short loop."""
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    a @ b
    best, end = 0.0, time.perf_counter() + budget_s
    while True:
        t0 = time.perf_counter()
        a @ b
        dt = time.perf_counter() - t0
        best = max(best, 2.0 * m * n * k / dt)
        if time.perf_counter() > end:
            return best


def memory_bandwidth() -> float:
    """Bytes/s of a 64 MiB fp32 copy (reads and writes counted), best of a few."""
    src = torch.randn(16 * 2**20)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(5))
    return 2 * src.numel() * 4 / best


def memory_capacity() -> tuple[int, str]:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024, "/proc/meminfo MemTotal"
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "os.sysconf(SC_PHYS_PAGES)"


def overlap_slowdown() -> float:
    """Matmul time while a 16 MiB all-reduce runs (gloo's own thread) over matmul time alone."""
    a, b = torch.randn(256, 256), torch.randn(256, 256)

    def work():
        for _ in range(20):
            a @ b
    return overlap_ratio(work, _timed, torch.ones(4 * 2**20))


def _cpu_device(progress, per_node: int, quick: bool = False) -> tuple[dict, dict, float, float]:
    """(device object, its sources, overlap_slowdown, compute_slots) of a CPU process, every rank
    at once (a device here is a process; they share the machine's cores). `quick`: the products up
    to 512 x 512 x 512 only (a CPU without bf16 instructions takes seconds for each larger bf16 one)."""
    shapes = [(256, 384, 128), (256, 128, 384), (512, 512, 512), (1024, 1536, 512), (256, 4096, 512)]
    squares = (512, 1024)
    if quick:
        shapes, squares = shapes[:3], squares[:1]
    peak, eff = {}, {}
    for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):  # the runtime computes in either
        peak[name] = mean_over_ranks(max(matmul_rate(s, s, s, dtype=dt) for s in squares))
        achieved = mean_over_ranks(statistics.median(matmul_rate(*s, budget_s=0.05, dtype=dt) for s in shapes))
        eff[name] = min(1.0, achieved / peak[name])
    bw = mean_over_ranks(memory_bandwidth())
    conv = {k: mean_over_ranks(v) for k, v in conversion_bandwidth(2**24, 5).items()}
    progress.step("device")
    slow = overlap_slowdown()
    slots = compute_slots()
    progress.step("overlap")
    mem, mem_src = memory_capacity()
    device = {
        "name": "cpu process",
        "memory_bytes": int(mem // per_node),
        "peak_flops": peak,
        "matmul_efficiency": eff,
        "memory_bandwidth_bytes_per_s": bw,
        "memory_bandwidth_efficiency": 1.0,
        "conversion_bandwidth_bytes_per_s": conv,
        "reserved_bytes": 0,
        "allocator_overhead_fraction": 0.0,
    }
    sources = {
        "device.peak_flops": "measured: torch.matmul in fp32 and in bf16 on every rank at once; 'peak' is the "
                             f"best rate of a square {'/'.join(map(str, squares))} matmul on this CPU (no "
                             "datasheet peak for a CPU process), averaged over ranks",
        "device.matmul_efficiency": "measured: median rate at transformer-like shapes "
                                    f"{shapes} over the measured peak above, per dtype",
        "device.memory_bandwidth_bytes_per_s": "measured: best of 5 copies of a 64 MiB fp32 tensor, "
                                               "2 x 64 MiB moved, every rank at once; efficiency 1 "
                                               "because this is the achieved rate",
        "device.conversion_bandwidth_bytes_per_s": "measured: best of 5 of a 2^24-element bf16 tensor cast to "
                                                   "float32 (upcast) and of its rows of 8192 less a float32 per-row "
                                                   "value into float32 (broadcast), every rank at once",
        "device.memory_bytes": f"measured: {mem_src} divided by the {per_node} processes of a host",
        "device.reserved_bytes": "assumption: 0 on CPU (no device context; run.json counts the tensors alive at the "
                                 "step's start and the heap allocated above them)",
        "overlap_slowdown": "measured: 20 matmuls of 256^3 with and without a 16 MiB all-reduce running "
                            "asynchronously, median of 5, mean over ranks",
        "compute_slots": "measured: 120 matmuls of 256^3 timed on rank 0 alone and on every rank at once "
                         "from a barrier to the last rank's end (median of 3 each); world x alone / "
                         "together, within [1, world]",
    }
    return device, sources, slow, slots


def _slug(name: str) -> str:
    return "-".join("".join(c if c.isalnum() else " " for c in name.lower()).split()) or "gpu"


def profile_cluster(args) -> dict | None:
    world, rank = dist.get_world_size(), dist.get_rank()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    hosts = [None] * world
    dist.all_gather_object(hosts, node_key())
    order = list(dict.fromkeys(hosts))
    node_of_rank = [order.index(h) for h in hosts]
    nodes = len(order)
    layout = group_layout(node_of_rank)
    gpu = current().type == "cuda"
    sizes = sizes_for(current(), args.quick)
    progress = Progress(2 * len(sizes) * group_points(layout) + 2, rank == 0)

    per_node = max(node_of_rank.count(i) for i in range(nodes))
    if gpu:
        from runtime import profile_gpu
        device, dev_sources, slow, slots = profile_gpu.measure_device(args.quick)
        progress.step("device")
        progress.step("overlap")
    else:
        device, dev_sources, slow, slots = _cpu_device(progress, per_node, args.quick)
        warning = host_warning(slots, lead="\n" if rank == 0 else "")  # the progress bar's line is open
        if warning:
            dev_sources["compute_slots"] += f"; WARNING: {warning}"
    points = sweep(sizes, 5 if args.quick else 9, progress, layout)
    if gpu:  # NCCL's communicators and buffers exist now
        device["reserved_bytes"] = profile_gpu.reserved_outside_allocator()
    if rank != 0:
        return None

    colls, fits_out = {}, {}
    for op in OPS:
        tiers = {}
        for kind, tier_name in (("intra", "intra_node"), ("cross", "inter_node")):
            if kind not in points or not points[kind][op]:
                continue
            by = {}
            for n, pts in points[kind][op].items():
                xs, ts, ss = [p[0] for p in pts], [p[1] for p in pts], [p[2] for p in pts]
                a, bw_ = fit_alpha_beta(xs, ts)
                # planner.cluster prices a group spanning nodes at min(intra, k * inter busbw), k its
                # members per node (one NIC per device): store the per-device figure, measured / k
                k = 1 if kind == "intra" or op == "send_recv" else per_node_of(layout[kind][n][0], node_of_rank)
                segs = [{"up_to_bytes": up, "alpha_s": sa, "bus_bandwidth_bytes_per_s": sb / k}
                        for up, sa, sb in fit_segments(ss, xs, ts)]
                by[str(n)] = {"alpha_s": a, "bus_bandwidth_bytes_per_s": bw_ / k, "segments": segs}
                if k != 1:
                    by[str(n)]["members_per_node"] = k
                fits_out.setdefault(op, {})[str(n) if kind == "intra" else f"{n}x"] = [[s, t] for _, t, s in pts]
            top = by[str(max(points[kind][op]))]
            tiers[tier_name] = {"alpha_s": top["alpha_s"], "bus_bandwidth_bytes_per_s": top["bus_bandwidth_bytes_per_s"],
                                "by_group_size": by}
        if "inter_node" not in tiers:
            tiers["inter_node"] = json.loads(json.dumps(tiers["intra_node"]))
        if "intra_node" not in tiers:  # one process per node: no group inside a node to time
            tiers["intra_node"] = json.loads(json.dumps(tiers["inter_node"]))
        colls[op] = tiers
    if gpu:
        name = args.name or f"{_slug(device['name'])}-nccl-{world}"
        what, links = f"{world} GPUs (NCCL)", ("NCCL inside a node (NVLink / PCIe)", "NCCL across nodes")
        backend = "nccl"
    else:
        name = args.name or f"cpu-gloo-{world}"
        device["name"] = f"cpu process ({local_world} per host)"
        what, links = f"{world} gloo processes", ("gloo over loopback TCP", "gloo over TCP")
        backend = "gloo"
    return {
        "format_version": 1,
        "name": name,
        "description": f"measured: {what} on {nodes} host(s) ({', '.join(order)}), "
                       f"torch {torch.__version__}, {os.cpu_count()} CPUs",
        "kind": "measured",
        "backend": backend,
        "devices_per_node": per_node,
        "nodes": nodes,
        "device": device,
        "tiers": {"intra_node": {"link": links[0]}, "inter_node": {"link": links[1]}},
        "collectives": colls,
        "topology": {"node_of_rank": node_of_rank},
        "overlap_slowdown": slow,
        "compute_slots": slots,
        "sweep": fits_out,
        "sources": {
            **dev_sources,
            "collectives": "measured: the smaller of two medians over repeats (max over ranks; two passes over "
                           "the sizes), made non-decreasing in the size (runtime.comm_sweep.monotone), of a sweep of "
                           f"{sizes[0] // 1024} KiB .. {sizes[-1] // 1024} KiB, all groups of a size at once; "
                           "fit t = alpha + factor(n) * S / busbw by least squares on relative error "
                           "(planner.model_profile.fit_alpha_beta), and piecewise over runs of sizes where one "
                           "line does not reproduce every point within 15% (by_group_size.N.segments, "
                           "planner.model_profile.fit_segments: gloo switches algorithms with the size); "
                           "the tier default is the largest group's fit; "
                           "raw points under 'sweep'",
            "collectives.*.inter_node": ("copied from the intra-node fit: every rank ran on one host, so there "
                                         "is no inter-node link to measure") if nodes == 1 else
                                        ("measured on groups spanning nodes, all groups of a size at once (ranks "
                                         "ordered node-minor and cut into groups: runtime.comm_sweep.group_layout); "
                                         "busbw is per device: the measured busbw over the group's members per "
                                         "node (planner.cluster prices a spanning group at min(intra, k * inter)); "
                                         "the tier default is the largest spanning group's fit; raw points under "
                                         "'sweep' as 'Nx'"),
            "topology.node_of_rank": "measured: socket.gethostname() of every rank, with torchrun's node rank "
                                     "(GROUP_RANK) where set",
        },
    }


def _init() -> None:
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ.setdefault("MASTER_PORT", str(s.getsockname()[1]))
    from runtime.device import init
    backend, _ = init(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=timedelta(minutes=10))


def parse_args(argv):
    ap = OneLineParser(prog="trident profile", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    c = sub.add_parser("cluster", help="measure devices and collectives")
    c.add_argument("-o", "--out", required=True)
    c.add_argument("--name", type=profile_name, default=None, help="profile name (default cpu-gloo-N)")
    c.add_argument("--quick", action="store_true", help="fewer sizes and repeats, smaller products (tests)")
    m = sub.add_parser("model", help="measure per-layer times and bytes of a model")
    m.add_argument("--model", required=True)
    m.add_argument("--cluster-profile", required=True)
    m.add_argument("--seq-len", type=int, required=True)
    m.add_argument("--micro-batches", default="1,2,4")
    m.add_argument("--tp", default="1")
    m.add_argument("--cp", default="1", help="context-parallel degrees to measure the block at too, e.g. 1,2")
    m.add_argument("--repeats", type=int, default=7)
    m.add_argument("--dtype", choices=("fp32", "bf16"), default=None,
                   help="compute dtype, as the runtime trains (default: bf16 on GPUs, fp32 on the CPU)")
    m.add_argument("--name", type=profile_name, default=None)
    m.add_argument("-o", "--out", required=True)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    from planner.model import ConfigError
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        from runtime.run_checks import check_out_file
        check_out_file("--out", args.out, f"{args.what}.json")
        if args.what == "cluster" and int(os.environ.get("WORLD_SIZE", "1")) < 2:
            raise ConfigError("profile cluster: needs at least 2 processes to time collectives; "
                              "launch it with torchrun --nproc-per-node N (N >= 2)")
        if args.what == "model":
            from runtime.profile_model import check_args
            check_args(args, int(os.environ.get("WORLD_SIZE", "1")))
    except ConfigError as exc:
        return fail(str(exc))
    try:
        _init()
    except ConfigError as exc:
        return fail(str(exc))
    try:
        if args.what == "cluster":
            out = profile_cluster(args)
        else:  # a busy host before or after the measurements: a warning in the profile
            from runtime.profile_model import profile_model
            busy = host_warning()
            out = profile_model(args)
            busy = host_warning() or busy
            if out is not None and busy:
                out["sources"]["times"] += f"; WARNING: {busy}"
        if out is not None:  # the reader's own checks first: never write a profile it would refuse
            from planner.cluster import cluster_from_dict
            from planner.model_profile import model_profile_from_dict
            from planner.plan import dumps
            check = cluster_from_dict if args.what == "cluster" else model_profile_from_dict
            text = dumps(out)
            check(json.loads(text), source=f"the measured profile for {args.out} (not written)")
            try:
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.out).write_text(text)
            except OSError as exc:
                raise ConfigError(f"--out: cannot write {args.out} ({exc.strerror or exc}); the profile is lost")
            print(f"wrote {args.out}", flush=True)
        dist.barrier()
        return 0
    except ConfigError as exc:
        return fail(str(exc))
    finally:
        dist.destroy_process_group()


def launch(argv) -> int:
    """`trident profile cluster|model ARGS [--nproc-per-node N]`: run this module under torchrun
    with N processes on this machine (default 4; a free port; OMP_NUM_THREADS=1 per process unless
    set), through runtime.torchrun so that a failure ends in one line. Returns its exit status."""
    from runtime.launch import run_local
    argv = list(argv)
    nproc = "4"
    if "--nproc-per-node" in argv:
        i = argv.index("--nproc-per-node")
        if i + 1 >= len(argv) or not decimal(argv[i + 1]) or int(argv[i + 1]) < 1:
            print("trident: error: --nproc-per-node needs a positive integer", file=sys.stderr)
            return 2
        nproc = argv[i + 1]
        del argv[i:i + 2]
    args = parse_args(argv)  # bad arguments: one line here, not one per rank
    from planner.model import ConfigError
    try:
        from runtime.run_checks import check_out_file
        check_out_file("--out", args.out, f"{args.what}.json")
        if args.what == "cluster" and int(nproc) < 2:
            raise ConfigError("--nproc: profile cluster needs at least 2 processes to time collectives")
        if args.what == "model":
            from runtime.profile_model import check_args
            check_args(args, int(nproc))
    except ConfigError as exc:
        print(f"trident: error: {exc}", file=sys.stderr)
        return 2
    return run_local(int(nproc), ["-m", "runtime.profile", *argv])


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # see runtime/train.py: gloo teardown can abort at interpreter exit
