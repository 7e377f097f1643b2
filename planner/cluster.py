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
- `device.matmul_flops_by_size`: sustained GEMM FLOP/s at square sizes ([[edge, flop/s], ...]
  per dtype). A product M x K x N runs at the rate of the square GEMM of the same arithmetic
  intensity (FLOPs per element read or written: 2MNK / (MK + KN + MN), which for an n-cube is
  2n/3), edge 3MNK / (MK + KN + MN), interpolated in log(edge) and clamped to the measured range;
  dtypes without a curve run at peak x matmul_efficiency. Intensity, not FLOPs, sets what a
  product reaches (the roofline's premise, Williams et al. 2009): on the three non-square
  products of the source table the intensity edge misses by +1.3, +11 and -24% where the edge of
  equal FLOPs, (MNK)^(1/3), missed by +1.5, +17 and +52% (profiles/hardware/dgx-a100-80gb.json,
  sources).
- `device.attention_flops`: FLOP/s of fused (flash) attention per dtype, forward and backward
  together, as FlashAttention's benchmark counts them (4 s^2 d per head forward, 2.5x that
  backward). Fused attention is not a library GEMM: FlashAttention-2 reaches 50-73% of the dense
  peak (Dao 2023), below what cuBLAS sustains. Without it, fused attention runs at peak x
  matmul_efficiency.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import networkx as nx

from planner.model import ConfigError

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
TIERS = ("intra_node", "inter_node")
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


def _interp(curve: tuple, x: float, log_y: bool) -> float:
    """y at x on measured (x, y) points, ascending in x: interpolated in log(x) (and in log(y)
    with `log_y`), held at the end values outside the measured range."""
    if x <= curve[0][0]:
        return curve[0][1]
    for (x1, y1), (x2, y2) in zip(curve, curve[1:]):
        if x <= x2:
            f = math.log(x / x1) / math.log(x2 / x1)
            return math.exp(math.log(y1) + f * math.log(y2 / y1)) if log_y else y1 + f * (y2 - y1)
    return curve[-1][1]


def _busbw_at(curve: tuple, nbytes: float) -> float:
    """Bus bandwidth at `nbytes` from measured (bytes, busbw) points (module doc)."""
    s0, b0 = curve[0]
    if nbytes <= s0:
        return b0 * nbytes / s0  # the smallest message's time: latency-bound below it
    return _interp(curve, nbytes, log_y=True)


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    memory_bytes: int
    peak_flops: dict
    matmul_efficiency: dict
    memory_bandwidth_bytes_per_s: float
    memory_bandwidth_efficiency: float
    reserved_bytes: int = 0  # held outside the allocator: runtime context, communicator buffers
    allocator_overhead_fraction: float = 0.0  # caching-allocator fragmentation, as a fraction of what it hands out
    matmul_by_size: dict = field(default_factory=dict)  # dtype -> ((edge, flop/s), ...) measured, ascending
    attention_flops: dict = field(default_factory=dict)  # dtype -> fused attention FLOP/s, measured

    def matmul_flops_per_s(self, dtype: str) -> float:
        return self.peak_flops[dtype] * self.matmul_efficiency[dtype]

    def attention_flops_per_s(self, dtype: str) -> float:
        """Achieved FLOP/s of fused (flash) attention, forward and backward together, where the
        profile measured it (module doc), else matmul_flops_per_s."""
        return self.attention_flops.get(dtype) or self.matmul_flops_per_s(dtype)

    def gemm_flops_per_s(self, dtype: str, M: float, N: float, K: float) -> float:
        """Achieved FLOP/s of an M x K by K x N product: the measured curve at the edge of the
        square product of equal arithmetic intensity, 3MNK / (MK + KN + MN), where the profile
        has one for `dtype` (module doc), else matmul_flops_per_s."""
        curve = self.matmul_by_size.get(dtype)
        if not curve:
            return self.matmul_flops_per_s(dtype)
        M, N, K = float(M), float(N), float(K)
        edge = 3.0 * M * N * K / (M * K + K * N + M * N)
        return _interp(curve, edge, log_y=False)

    @property
    def memory_bytes_per_s(self) -> float:
        return self.memory_bandwidth_bytes_per_s * self.memory_bandwidth_efficiency


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
        ranks = list(ranks)
        n = len(ranks)
        if n <= 1 or nbytes <= 0:
            return 0.0
        per_node: dict[int, int] = {}
        for r in ranks:
            per_node[self.node_of(r)] = per_node.get(self.node_of(r), 0) + 1
        intra_a, intra_bw = self.collectives[op]["intra_node"].at(n, nbytes)
        if len(per_node) == 1:
            return intra_a + ring_factor(op, n) * nbytes / intra_bw
        inter_a, inter_bw = self.collectives[op]["inter_node"].at(n, nbytes)
        k = max(per_node.values())
        if op == "send_recv":
            return inter_a + nbytes / inter_bw
        if op == "all_to_all":  # the share that leaves the node goes through this rank's own NIC
            return inter_a + nbytes * (n - k) / n / inter_bw + nbytes * (k - 1) / n / intra_bw
        # a ring through k members of a node and its NICs runs at the pace of its slower tier
        f = ring_factor(op, n)
        return max(inter_a + f * nbytes / (k * inter_bw), intra_a + f * nbytes / intra_bw)

    def p2p_time(self, nbytes: float, src: int, dst: int) -> float:
        return self.collective_time("send_recv", nbytes, [src, dst]) if src != dst else 0.0


def _num(d: dict, key: str, where: str, positive: bool = True) -> float:
    v = d.get(key)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or (positive and v <= 0) or v < 0:
        raise ConfigError(f"{where}.{key}: {v!r} must be a {'positive ' if positive else 'non-negative '}number")
    return float(v)


def _curve(points, where: str, x: str, y: str) -> tuple:
    """A measured curve [[x, y], ...]: at least two points, positive, x strictly ascending."""
    ok = isinstance(points, list) and len(points) >= 2 and all(
        isinstance(p, list) and len(p) == 2 and all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
                                                     for v in p) for p in points)
    if not ok:
        raise ConfigError(f"{where}: expected a list of at least two [{x}, {y}] pairs of positive numbers")
    if any(b[0] <= a[0] for a, b in zip(points, points[1:])):
        raise ConfigError(f"{where}: the {x} values must rise strictly from one point to the next")
    return tuple((float(a), float(b)) for a, b in points)


def _matmul_curves(d, peak: dict, where: str) -> dict:
    if d is None:
        return {}
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: expected an object of dtype -> [[edge, flop/s], ...]")
    out = {}
    for k, points in d.items():
        if k not in peak:
            raise ConfigError(f"{where}.{k}: no peak_flops for this dtype; use one of {', '.join(peak)}")
        out[k] = _curve(points, f"{where}.{k}", "edge", "flop/s")
        if any(r > peak[k] for _, r in out[k]):
            raise ConfigError(f"{where}.{k}: a rate above peak_flops.{k}; give achieved FLOP/s")
    return out


def _rates(d, peak: dict, where: str) -> dict:
    if d is None:
        return {}
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: expected an object of dtype -> FLOP/s")
    for k in d:
        if k not in peak:
            raise ConfigError(f"{where}.{k}: no peak_flops for this dtype; use one of {', '.join(peak)}")
        if _num(d, k, where) > peak[k]:
            raise ConfigError(f"{where}.{k}: above peak_flops.{k}; give achieved FLOP/s")
    return {k: float(v) for k, v in d.items()}


def cluster_from_dict(d: dict, source: str = "cluster") -> ClusterSpec:
    """Parse and check a cluster profile; errors name the field."""
    if not isinstance(d, dict):
        raise ConfigError(f"{source}: expected a JSON object")
    fv = d.get("format_version")
    if fv != 1:
        raise ConfigError(f"{source}: format_version {fv!r} is not supported (this trident reads 1); "
                          "re-run `trident profile cluster` or use a shipped profile")
    for key in ("name", "devices_per_node", "device", "collectives"):
        if key not in d:
            raise ConfigError(f"{source}: missing field {key!r}")
    dpn = d["devices_per_node"]
    if not isinstance(dpn, int) or dpn < 1:
        raise ConfigError(f"{source}: devices_per_node {dpn!r} must be a positive integer")
    dv = d["device"]
    w = f"{source}: device"
    if not isinstance(dv, dict):
        raise ConfigError(f"{w}: expected an object")
    peak, eff = dv.get("peak_flops"), dv.get("matmul_efficiency")
    if not isinstance(peak, dict) or not peak:
        raise ConfigError(f"{w}.peak_flops: expected an object of dtype -> FLOP/s")
    if not isinstance(eff, dict) or set(eff) != set(peak):
        raise ConfigError(f"{w}.matmul_efficiency: must give one efficiency per dtype of peak_flops ({', '.join(peak)})")
    for k in peak:
        _num(peak, k, f"{w}.peak_flops")
        e = _num(eff, k, f"{w}.matmul_efficiency")
        if e > 1:
            raise ConfigError(f"{w}.matmul_efficiency.{k}: {e} is above 1; it is achieved / peak")
    device = DeviceSpec(
        name=str(dv.get("name", "unknown")),
        memory_bytes=int(_num(dv, "memory_bytes", w)),
        peak_flops={k: float(v) for k, v in peak.items()},
        matmul_efficiency={k: float(v) for k, v in eff.items()},
        memory_bandwidth_bytes_per_s=_num(dv, "memory_bandwidth_bytes_per_s", w),
        memory_bandwidth_efficiency=_num(dv, "memory_bandwidth_efficiency", w),
        reserved_bytes=int(_num(dv, "reserved_bytes", w, positive=False)) if "reserved_bytes" in dv else 0,
        allocator_overhead_fraction=(_num(dv, "allocator_overhead_fraction", w, positive=False)
                                     if "allocator_overhead_fraction" in dv else 0.0),
        matmul_by_size=_matmul_curves(dv.get("matmul_flops_by_size"), peak, f"{w}.matmul_flops_by_size"),
        attention_flops=_rates(dv.get("attention_flops"), peak, f"{w}.attention_flops"),
    )
    coll = d["collectives"]
    if not isinstance(coll, dict):
        raise ConfigError(f"{source}: collectives must be an object")
    collectives = {}
    for op in COLLECTIVES:
        if op not in coll:
            raise ConfigError(f"{source}: collectives.{op} is missing; a profile needs {', '.join(COLLECTIVES)}")
        collectives[op] = {}
        for tier in TIERS:
            ab = coll[op].get(tier) if isinstance(coll[op], dict) else None
            wt = f"{source}: collectives.{op}.{tier}"
            if not isinstance(ab, dict):
                raise ConfigError(f"{wt}: missing; give alpha_s and bus_bandwidth_bytes_per_s")
            by_n, segs = {}, {}
            for n, v in (ab.get("by_group_size") or {}).items():
                wn = f"{wt}.by_group_size.{n}"
                if not str(n).isdigit() or not isinstance(v, dict):
                    raise ConfigError(f"{wn}: expected a group size mapped to an object with alpha_s and "
                                      "bus_bandwidth_bytes_per_s")
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
                        up = sg.get("up_to_bytes")
                        if up is not None:
                            up = _num(sg, "up_to_bytes", ws)
                        segs[int(n)].append((up, _num(sg, "alpha_s", ws, positive=False),
                                             _num(sg, "bus_bandwidth_bytes_per_s", ws)))
            by_size = (_curve(ab["bus_bandwidth_by_size"], f"{wt}.bus_bandwidth_by_size", "bytes", "busbw")
                       if "bus_bandwidth_by_size" in ab else ())
            collectives[op][tier] = AlphaBeta(_num(ab, "alpha_s", wt, positive=False),
                                              _num(ab, "bus_bandwidth_bytes_per_s", wt), by_n, segs, by_size)
    topo = d.get("topology")
    node_of_rank = None
    if topo is not None:
        node_of_rank = topo.get("node_of_rank") if isinstance(topo, dict) else None
        if not isinstance(node_of_rank, list) or not all(isinstance(x, int) for x in node_of_rank):
            raise ConfigError(f"{source}: topology.node_of_rank must be a list of node indices, one per rank")
    slots = d.get("compute_slots")
    if slots is not None:
        slots = _num(d, "compute_slots", source)
    nodes = d.get("nodes")
    if nodes is not None and (not isinstance(nodes, int) or nodes < 1):
        raise ConfigError(f"{source}: nodes {nodes!r} must be a positive integer or null")
    return ClusterSpec(
        name=str(d["name"]), devices_per_node=dpn, device=device, collectives=collectives, nodes=nodes,
        description=str(d.get("description", "")), kind=str(d.get("kind", "datasheet")),
        tiers=d.get("tiers", {}), sources=d.get("sources", {}), node_of_rank=node_of_rank,
        overlap_slowdown=float(d.get("overlap_slowdown", 1.0)), compute_slots=slots, raw=d)


def read_profile(spec, directory: Path, flag: str) -> tuple[Path, object, str]:
    """(path, parsed JSON, "sha256:..." of the bytes) of a profile given as a path or as a name
    of a file in `directory`; one-line ConfigError naming `flag` otherwise."""
    path = Path(spec)
    if not path.exists():
        path = directory / f"{spec}.json"
    if not path.exists():
        known = sorted(p.stem for p in directory.glob("*.json"))
        raise ConfigError(f"{flag}: {spec!r} is neither a file nor a profile in {directory} ({', '.join(known)})")
    text = path.read_bytes()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{flag}: {path} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    return path, data, "sha256:" + hashlib.sha256(text).hexdigest()


def load_cluster(spec: str, nodes: int | None = None) -> ClusterSpec:
    """A shipped profile name (profiles/hardware/NAME.json) or a path to a profile JSON."""
    path, data, digest = read_profile(spec, PROFILE_DIR, "--cluster")
    cluster = cluster_from_dict(data, source=str(path))
    cluster.profile_hash = digest
    if nodes is not None:
        cluster = cluster.with_nodes(nodes)
    return cluster
