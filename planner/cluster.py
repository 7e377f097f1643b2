"""Cluster specification: devices, link tiers, and the alpha-beta cost of each collective.

A profile JSON (profiles/hardware/*.json, shipped from datasheets or written by
`trident profile cluster`) gives, per collective and per tier, a latency alpha and a bus
bandwidth in the nccl-tests sense (NVIDIA nccl-tests, doc/PERFORMANCE.md): the time of a
collective over n ranks on S bytes is

    t = alpha + factor(n) * S / busbw,   factor = 2(n-1)/n all-reduce, (n-1)/n all-gather,
                                          reduce-scatter and all-to-all, 1 for send/recv.

S is the full buffer: the all-reduce buffer, the gathered output of an all-gather, the input of
a reduce-scatter. A group inside one node pays the intra-node tier. A group spanning nodes
pays the inter-node tier; its bus bandwidth is per device (one NIC per GPU, rail-optimized, as
in DGX nodes), so a ring with k members per node runs k rings over k NICs in parallel and
reaches k * inter busbw, unless the node's own links are slower: the time is the larger of the
two tiers' times. A profile may override alpha and busbw for a given
group size (`by_group_size`), which a measured profile does, and per message-size range
(`by_group_size.N.segments`, piecewise fits written by `trident profile cluster`).

Measured curves, where a profile has them, replace the straight lines:
- `bus_bandwidth_by_size`: nccl-tests bus bandwidth at each message size ([[bytes, busbw], ...],
  any group size of the tier: busbw is defined to be independent of the rank count, NVIDIA
  nccl-tests doc/PERFORMANCE.md). Between points busbw is interpolated in log-log; below the
  smallest size the time is that of the smallest size; above the largest, busbw stays at its
  last value. Mid-size messages run well below the large-message busbw (NCCL's protocols and
  channel counts change with the size), which one alpha-beta line cannot follow.
- The device's curves (GEMM rate by size, fused attention rate by sequence length):
  planner.device.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import networkx as nx
import numpy as np

from planner.device import DeviceSpec, _curve, _interp, _num, device_from_dict  # noqa: F401 (DeviceSpec: re-exported)
from planner.model import MAX_NAME, ConfigError, is_int, is_one_line, is_real
from planner.profile_checks import (PROFILE_KEYS, check_finite, check_keys, check_node_of_rank, check_segments,
                                    decimal, read_json)

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
TIERS = ("intra_node", "inter_node")
TIER_KEYS = ("alpha_s", "bus_bandwidth_bytes_per_s", "bus_bandwidth_by_size", "by_group_size")
# the largest node a profile may describe: far above today's largest NVLink domain (72 GPUs, GB200 NVL72)
MAX_DEVICES_PER_NODE = 1024
MAX_NODES = 1 << 20  # a profile's nodes (a million nodes; more is not a cluster)
PROFILE_DIR = Path(__file__).resolve().parent.parent / "profiles" / "hardware"


def ring_factor(op: str, n: int) -> float:
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


@dataclass(frozen=True)
class AlphaBeta:
    alpha_s: float
    bus_bandwidth_bytes_per_s: float
    by_group_size: dict = field(default_factory=dict)  # {n: (alpha_s, busbw)}
    segments: dict = field(default_factory=dict)  # {n: [(up_to_bytes or None, alpha_s, busbw), ...]}
    by_size: tuple = ()  # ((bytes, busbw), ...) measured, ascending: bus_bandwidth_by_size

    @property
    def affine(self) -> bool:
        """Whether the time is one alpha + beta x bytes line for every message size."""
        return not self.segments and not self.by_size

    def at(self, n: int, nbytes: float | None = None) -> tuple[float, float]:
        """(alpha, busbw) for a group of n; a measured profile may refine it by message size
        (`by_group_size.N.segments`: piecewise fits, each up to a buffer size), and a measured
        curve (`bus_bandwidth_by_size`) gives busbw at each size with alpha 0 (see module doc)."""
        if nbytes is not None and n in self.segments:
            for up_to, a, bw in self.segments[n]:
                if up_to is None or nbytes <= up_to:
                    return a, bw
        if nbytes is not None and nbytes > 0 and self.by_size and n not in self.by_group_size:
            return 0.0, _busbw_at(self.by_size, nbytes)
        return self.by_group_size.get(n, (self.alpha_s, self.bus_bandwidth_bytes_per_s))

    def peak(self, n: int) -> tuple[float, float]:
        """(the smallest alpha, the largest busbw) this tier has for a group of n at any message
        size: `at` interpolates a measured curve between its points and holds its end values."""
        pts = [self.at(n)] + [(a, bw) for _, a, bw in self.segments.get(n, ())]
        if self.by_size and n not in self.by_group_size:
            pts += [(0.0, bw) for _, bw in self.by_size]
        return min(a for a, _ in pts), max(bw for _, bw in pts)


def _busbw_at(curve: tuple, nbytes: float) -> float:
    """Bus bandwidth at `nbytes` from measured (bytes, busbw) points (module doc)."""
    s0, b0 = curve[0]
    if nbytes <= s0:
        return b0 * nbytes / s0  # the smallest message's time: latency-bound below it
    return _interp(curve, nbytes, log_y=True)


@dataclass
class ClusterSpec:
    name: str
    devices_per_node: int
    device: DeviceSpec
    collectives: dict  # op -> tier -> AlphaBeta
    nodes: int | None = None
    description: str = ""
    kind: str = "datasheet"
    tiers: dict = field(default_factory=dict)
    sources: dict = field(default_factory=dict)
    node_of_rank: list | None = None  # measured topology: node index of each rank
    overlap_slowdown: float = 1.0  # compute slowdown while communication overlaps it (measured)
    # devices that compute at full speed at once on the profile's `nodes` (measured; None: each
    # device has its own compute, as GPUs do), scaled with the node count. Processes sharing CPU
    # cores share them: planner.schedule.Sharing
    compute_slots: float | None = None
    # the collectives' library: "nccl" (GPUs), or "gloo" (CPU processes), whose reduce-scatter and
    # all-gather take temporaries as large as their input and output (planner.fsdp_memory)
    backend: str = "nccl"
    profile_hash: str = ""
    raw: dict = field(default_factory=dict, repr=False)

    # ------------------------------------------------------------ placement
    @property
    def world_size(self) -> int:
        if self.nodes is None:
            raise ConfigError("cluster: number of nodes unknown; pass --nodes or --gpus")
        return self.nodes * self.devices_per_node

    def with_nodes(self, nodes: int) -> "ClusterSpec":
        if not isinstance(nodes, int) or nodes < 1:
            raise ConfigError(f"--nodes: {nodes!r} must be a positive integer")
        out = ClusterSpec(**{**self.__dict__, "nodes": nodes})
        if self.compute_slots is not None and self.nodes:  # more nodes, more cores
            out.compute_slots = self.compute_slots * nodes / self.nodes
        if self.node_of_rank is not None and len(self.node_of_rank) != nodes * self.devices_per_node:
            out.node_of_rank = None
        return out

    def shaped_as(self, nodes: int, devices_per_node: int) -> "ClusterSpec":
        """This cluster with `nodes` nodes of which `devices_per_node` devices are used (a plan may
        use part of a node)."""
        if self.nodes == nodes and self.devices_per_node == devices_per_node:
            return self
        if devices_per_node > self.devices_per_node:
            raise ConfigError(f"cluster.devices_per_node: {devices_per_node} but a {self.name} node has "
                              f"{self.devices_per_node}; use --nodes or a matching profile")
        out = self.with_nodes(nodes)
        if devices_per_node != self.devices_per_node:
            out.devices_per_node = devices_per_node
            out.node_of_rank = None
        return out

    def node_of(self, rank: int) -> int:
        if self.node_of_rank is not None and rank < len(self.node_of_rank):
            return self.node_of_rank[rank]
        return rank // self.devices_per_node

    def nodes_of(self, ranks: np.ndarray) -> np.ndarray:
        """node_of of each rank in an integer array."""
        if not self.node_of_rank:
            return ranks // self.devices_per_node
        known = np.asarray(self.node_of_rank)
        inside = ranks < len(known)
        return np.where(inside, known[np.where(inside, ranks, 0)], ranks // self.devices_per_node)

    def topology(self) -> nx.Graph:
        """Ranks, the node switch of each node, and the fabric, as a graph whose edges carry the
        tier they belong to; the tier between two ranks is the slowest edge on the path."""
        g = nx.Graph()
        g.add_node("fabric", kind="fabric")
        for r in range(self.world_size):
            node = f"node{self.node_of(r)}"
            if node not in g:
                g.add_node(node, kind="node")
                g.add_edge(node, "fabric", tier="inter_node")
            g.add_node(r, kind="device")
            g.add_edge(r, node, tier="intra_node")
        return g

    def tier_between(self, a: int, b: int) -> str:
        return "intra_node" if self.node_of(a) == self.node_of(b) else "inter_node"

    # ------------------------------------------------------------ cost
    def collective_time(self, op: str, nbytes: float, ranks) -> float:
        """Seconds for collective `op` on `nbytes` over the group `ranks` (see module doc)."""
        return self.shaped_collective_time(op, nbytes, self.group_shape(ranks))

    def group_shape(self, ranks) -> tuple[int, int, int]:
        """What a collective's price depends on in its group: (members, nodes spanned, the most
        members on one node)."""
        if len(ranks) > 64:  # large groups (data parallelism over thousands of GPUs) at numpy's pace
            steps = isinstance(ranks, range) and ranks.step > 0
            nodes = self.nodes_of(np.arange(ranks.start, ranks.stop, ranks.step) if steps else np.asarray(ranks))
            if steps and not self.node_of_rank:  # rising: each node's members are one run
                cuts = np.flatnonzero(np.diff(nodes)) + 1
                counts = np.diff(np.concatenate(([0], cuts, [len(nodes)])))
            else:
                counts = np.unique(nodes, return_counts=True)[1]
            return len(ranks), len(counts), int(counts.max())
        per_node: dict[int, int] = {}
        for r in ranks:
            node = self.node_of(r)
            per_node[node] = per_node.get(node, 0) + 1
        return sum(per_node.values()), len(per_node), max(per_node.values(), default=0)

    def shaped_collective_time(self, op: str, nbytes: float, shape: tuple[int, int, int]) -> float:
        """collective_time for a group of `shape` (group_shape)."""
        n, nodes, k = shape
        if n <= 1 or nbytes <= 0:
            return 0.0
        intra_a, intra_bw = self.collectives[op]["intra_node"].at(n, nbytes)
        if nodes == 1:
            return intra_a + ring_factor(op, n) * nbytes / intra_bw
        inter_a, inter_bw = self.collectives[op]["inter_node"].at(n, nbytes)
        if op == "send_recv":
            return inter_a + nbytes / inter_bw
        if op == "all_to_all":  # the share that leaves the node goes through this rank's own NIC
            return inter_a + nbytes * (n - k) / n / inter_bw + nbytes * (k - 1) / n / intra_bw
        # a ring through k members of a node and its NICs runs at the pace of its slower tier
        f = ring_factor(op, n)
        return max(inter_a + f * nbytes / (k * inter_bw), intra_a + f * nbytes / intra_bw)

    def seconds_per_byte(self, op: str, shape: tuple[int, int, int]) -> float:
        """A slope c with shaped_collective_time(op, x, shape) >= c x for every x > 0: the time at
        each tier's largest bandwidth, without latency; 0 where a fitted latency is negative."""
        n, nodes, k = shape
        if n <= 1:
            return 0.0
        intra_a, intra_bw = self.collectives[op]["intra_node"].peak(n)
        if nodes == 1:
            return ring_factor(op, n) / intra_bw if intra_a >= 0 else 0.0
        inter_a, inter_bw = self.collectives[op]["inter_node"].peak(n)
        if min(intra_a, inter_a) < 0:
            return 0.0
        if op == "send_recv":
            return 1.0 / inter_bw
        if op == "all_to_all":
            return (n - k) / n / inter_bw + (k - 1) / n / intra_bw
        f = ring_factor(op, n)
        return max(f / (k * inter_bw), f / intra_bw)

    def p2p_time(self, nbytes: float, src: int, dst: int) -> float:
        return self.shaped_collective_time("send_recv", nbytes, self.group_shape((src, dst))) if src != dst else 0.0


def cluster_from_dict(d: dict, source: str = "cluster") -> ClusterSpec:
    """Parse and check a cluster profile; errors name the field."""
    if not isinstance(d, dict):
        raise ConfigError(f"{source}: expected a JSON object")
    fv = d.get("format_version")
    if not is_int(fv) or fv != 1:
        raise ConfigError(f"{source}: format_version {fv!r} is not supported (this trident reads 1); "
                          "re-run `trident profile cluster` or use a shipped profile")
    check_keys(d, PROFILE_KEYS, f"{source}: ")
    for key in ("name", "devices_per_node", "device", "collectives"):
        if key not in d:
            raise ConfigError(f"{source}: missing field {key!r}")
    check_finite(d, source)
    for key in ("name", "description", "kind"):
        if key in d and not isinstance(d[key], str):
            raise ConfigError(f"{source}: {key} {d[key]!r} must be a string")
    for key in ("tiers", "sources", "sweep"):
        if key in d and not isinstance(d[key], dict):
            raise ConfigError(f"{source}: {key} must be an object")
    for tier, info in d.get("tiers", {}).items():  # what each link is (the costs are the collectives')
        bw = info.get("bandwidth_bytes_per_s", 1.0) if isinstance(info, dict) else None
        if tier not in TIERS or not isinstance(info, dict) or not isinstance(info.get("link", ""), str) \
                or not (is_real(bw) and bw > 0):
            raise ConfigError(f"{source}: tiers.{tier}: a tier is {' or '.join(TIERS)}, an object with a 'link' "
                              "string and a positive 'bandwidth_bytes_per_s'; fix it or leave it out")
        check_keys(info, ("link", "bandwidth_bytes_per_s"), f"{source}: tiers.{tier}.")
    if not (is_one_line(d["name"]) and d["name"].strip()):
        raise ConfigError(f"{source}: name must be a non-empty printable string of one line, at most {MAX_NAME} "
                          "characters (plans refer to the cluster by it)")
    dpn = d["devices_per_node"]
    if not is_int(dpn) or dpn < 1:
        raise ConfigError(f"{source}: devices_per_node {dpn!r} must be a positive integer")
    if dpn > MAX_DEVICES_PER_NODE:
        raise ConfigError(f"{source}: devices_per_node {dpn} is more than {MAX_DEVICES_PER_NODE}; a node is the "
                          "devices one intra-node link joins (8 in a DGX, 72 in a GB200 NVL72)")
    device = device_from_dict(d["device"], f"{source}: device")
    coll = d["collectives"]
    if not isinstance(coll, dict):
        raise ConfigError(f"{source}: collectives must be an object")
    check_keys(coll, COLLECTIVES, f"{source}: collectives.")
    collectives = {}
    for op in COLLECTIVES:
        if op not in coll:
            raise ConfigError(f"{source}: collectives.{op} is missing; a profile needs {', '.join(COLLECTIVES)}")
        collectives[op] = {}
        if isinstance(coll[op], dict):
            check_keys(coll[op], TIERS, f"{source}: collectives.{op}.")
        for tier in TIERS:
            ab = coll[op].get(tier) if isinstance(coll[op], dict) else None
            wt = f"{source}: collectives.{op}.{tier}"
            if not isinstance(ab, dict):
                raise ConfigError(f"{wt}: missing; give alpha_s and bus_bandwidth_bytes_per_s")
            check_keys(ab, TIER_KEYS, f"{wt}.")
            by_n, segs = {}, {}
            by_group = {} if ab.get("by_group_size") is None else ab["by_group_size"]
            if not isinstance(by_group, dict):
                raise ConfigError(f"{wt}.by_group_size: expected an object of group size -> "
                                  "{alpha_s, bus_bandwidth_bytes_per_s}")
            for n, v in by_group.items():
                wn = f"{wt}.by_group_size.{n}"
                if not decimal(n) or int(n) < 1 or not isinstance(v, dict):
                    raise ConfigError(f"{wn}: expected a group size mapped to an object with alpha_s and "
                                      "bus_bandwidth_bytes_per_s")
                # members_per_node: what a measured group spanning nodes had on each (runtime.profile), a note
                check_keys(v, ("alpha_s", "bus_bandwidth_bytes_per_s", "segments", "members_per_node"), f"{wn}.")
                if "members_per_node" in v and not (is_int(v["members_per_node"]) and v["members_per_node"] >= 1):
                    raise ConfigError(f"{wn}.members_per_node: {v['members_per_node']!r} must be a positive integer")
                by_n[int(n)] = (_num(v, "alpha_s", wn, positive=False), _num(v, "bus_bandwidth_bytes_per_s", wn))
                if "segments" in v:
                    if not isinstance(v["segments"], list) or not v["segments"]:
                        raise ConfigError(f"{wn}.segments: expected a list of {{up_to_bytes, alpha_s, "
                                          "bus_bandwidth_bytes_per_s}}, the last with up_to_bytes null")
                    segs[int(n)] = []
                    for k, sg in enumerate(v["segments"]):
                        ws = f"{wn}.segments[{k}]"
                        if not isinstance(sg, dict):
                            raise ConfigError(f"{ws}: expected an object")
                        check_keys(sg, ("up_to_bytes", "alpha_s", "bus_bandwidth_bytes_per_s"), f"{ws}.")
                        up = sg.get("up_to_bytes")
                        if up is not None:
                            up = _num(sg, "up_to_bytes", ws)
                        segs[int(n)].append((up, _num(sg, "alpha_s", ws, positive=False),
                                             _num(sg, "bus_bandwidth_bytes_per_s", ws)))
                    check_segments(segs[int(n)], f"{wn}.segments")
            by_size = (_curve(ab["bus_bandwidth_by_size"], f"{wt}.bus_bandwidth_by_size", "bytes", "busbw")
                       if "bus_bandwidth_by_size" in ab else ())
            collectives[op][tier] = AlphaBeta(_num(ab, "alpha_s", wt, positive=False),
                                              _num(ab, "bus_bandwidth_bytes_per_s", wt), by_n, segs, by_size)
    slots = d.get("compute_slots")
    if slots is not None and not (is_real(slots) and 0.01 <= slots <= MAX_DEVICES_PER_NODE * MAX_NODES):
        raise ConfigError(f"{source}: compute_slots {slots!r} must be a number from 0.01 (full-speed computations "
                          "the ranks run at once), or null")
    nodes = d.get("nodes")
    if nodes is not None and (not is_int(nodes) or not 1 <= nodes <= MAX_NODES):
        raise ConfigError(f"{source}: nodes {nodes!r} must be a positive integer, at most {MAX_NODES}, or null")
    topo = d.get("topology")
    node_of_rank = None if topo is None else check_node_of_rank(topo, nodes, dpn, f"{source}: topology")
    # compute time while communication overlaps it over the time alone (runtime/profile.py): >= 1
    slow = d.get("overlap_slowdown", 1.0)
    if not isinstance(slow, (int, float)) or isinstance(slow, bool) or not 1 <= slow <= 100:
        raise ConfigError(f"{source}: overlap_slowdown {slow!r} must be a number from 1 to 100 (compute time "
                          "with communication overlapping it over the time alone); 1 for no slowdown")
    # profiles written before the field: CPU processes (a measured "cpu process" device) ran gloo
    backend = d.get("backend", "gloo" if str(device.name).startswith("cpu") else "nccl")
    if backend not in ("nccl", "gloo"):
        raise ConfigError(f"{source}: backend {backend!r} must be nccl or gloo (the collectives' library)")
    return ClusterSpec(
        name=d["name"], devices_per_node=dpn, device=device, collectives=collectives, nodes=nodes,
        description=str(d.get("description", "")), kind=str(d.get("kind", "datasheet")),
        tiers=d.get("tiers", {}), sources=d.get("sources", {}), node_of_rank=node_of_rank,
        overlap_slowdown=float(slow), compute_slots=slots, backend=backend, raw=d)


def read_profile(spec, directory: Path, flag: str) -> tuple[Path, object, str]:
    """(path, parsed JSON, "sha256:..." of the bytes) of a profile given as a path or as a name
    of a file in `directory`; one-line ConfigError naming `flag` otherwise."""
    known = lambda: ", ".join(sorted(p.stem for p in directory.glob("*.json"))) or "none shipped"  # noqa: E731
    if not str(spec).strip():
        raise ConfigError(f"{flag}: an empty name; give a profile in {directory} ({known()}) or a JSON file")
    path = Path(spec)
    if not path.exists():
        path = directory / f"{spec}.json"
    if not path.exists():
        several = "; several, comma-separated, are for `trident search`" if "," in str(spec) else ""
        raise ConfigError(f"{flag}: {spec!r} is neither a file nor a profile in {directory} ({known()}){several}")
    text, data = read_json(path, flag)
    return path, data, "sha256:" + hashlib.sha256(text).hexdigest()


def load_cluster(spec: str, nodes: int | None = None, flag: str = "--cluster") -> ClusterSpec:
    """A shipped profile name (profiles/hardware/NAME.json) or a path to a profile JSON; errors
    name `flag`, the option that gave it."""
    path, data, digest = read_profile(spec, PROFILE_DIR, flag)
    cluster = cluster_from_dict(data, source=str(path))
    cluster.profile_hash = digest
    if nodes is not None:
        cluster = cluster.with_nodes(nodes)
    return cluster
