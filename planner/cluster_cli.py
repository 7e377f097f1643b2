"""`trident cluster show|derive`: what a cluster profile says, and what-if profiles derived from it.

`derive` writes a profile for a cluster one does not have yet that differs from a shipped (or
measured) one in its network, its node size or its device memory:

- `--nic-gbps G [--nics-per-node K]`: each device's share of its node's inter-node bandwidth
  becomes G x K / devices per node (K defaults to one NIC per device). Every inter-node bus
  bandwidth of the base (each collective, each group size, each message size) is scaled by
  new share / base share, the base share being its `tiers.inter_node.bandwidth_bytes_per_s`
  (planner.cluster: inter-node bus bandwidth is per device). Latencies stay. Linear scaling is
  what the shipped profiles' sources report: NCCL's maintainers give about 24 GB/s of bus
  bandwidth per 200 Gb/s HDR NIC (dgx-a100-80gb) and 48 GB/s per 400 Gb/s NDR NIC
  (dgx-h100-80gb), 96% of the line rate at both; all-to-all cannot aggregate NICs (nccl-tests
  issue #267) and is priced on the same per-device share.
- `--devices-per-node D`: nodes of D devices (at most the base's: its intra-node figures were
  measured or published for nodes that size); each device keeps its inter-node share unless
  --nic-gbps / --nics-per-node say otherwise.
- `--memory-gib M`: the device's memory (GiB, as the shipped profiles record it).
- `--nvlink-mesh`: the node's devices link each pair directly, with an equal share of a device's
  NVLink ports, and no switch (NVIDIA's 4-GPU HGX boards: 6 of a Hopper GPU's 18 links to each of
  the other three, `nvidia-smi topo -m` printing NV6 for every pair; NVL bridges likewise). A
  collective among k devices of a node then drives k - 1 of a device's D - 1 link bundles: its
  intra-node bus bandwidth is (k - 1) / (D - 1) of the base's, whose devices reach every peer
  through the switch at their whole NVLink rate (NCCL's rings share the same per-link protocol
  overhead either way); a send between two devices drives one bundle. A measured curve
  (`bus_bandwidth_by_size`) is capped at its tier's flat figure, the ring's: the shipped curves
  above it are NVLink SHARP all-reduces, which need an NVSwitch. Its profile takes neither
  --nvlink-mesh nor another node size again (derive those from the switched profile).

The derived profile records its base (name and sha256), the changes, and for every changed field
its base value's source; its `kind` is "derived".
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

from planner.args import nonempty, number_in, positive_int, profile_name
from planner.cluster import COLLECTIVES, PROFILE_DIR, TIERS, cluster_from_dict, read_profile
from planner.model import ConfigError

GiB = 2**30


# a node's inter-node NICs at most, per device: the shipped nodes have one a device (DGX A100, H100,
# B200: 8 compute NICs for 8 GPUs), each device reaching them through its own PCIe link
MAX_NICS_A_DEVICE = 4
MESH_LINK = "linked directly, no switch"  # in a --nvlink-mesh profile's tiers.intra_node.link


def _share_gbps(bytes_per_s: float) -> float:
    return bytes_per_s * 8 / 1e9


def derive(base: dict, base_name: str, base_hash: str, name: str, nic_gbps: float | None = None,
           nics_per_node: int | None = None, devices_per_node: int | None = None,
           memory_gib: float | None = None, mesh: bool = False) -> tuple[dict, list[str]]:
    """(the derived profile, a line per change); `base` is a checked profile dict."""
    if nic_gbps is None and nics_per_node is None and devices_per_node is None and memory_gib is None and not mesh:
        raise ConfigError("cluster derive: nothing to change; give --nic-gbps, --nics-per-node, "
                          "--devices-per-node, --memory-gib or --nvlink-mesh")
    out = copy.deepcopy(base)
    sources = out.setdefault("sources", {})
    changes = []
    dpn_base = base["devices_per_node"]
    dpn = devices_per_node or dpn_base
    if MESH_LINK in base.get("tiers", {}).get("intra_node", {}).get("link", "") and (mesh or dpn != dpn_base):
        raise ConfigError(f"{'--nvlink-mesh' if mesh else '--devices-per-node'}: {base_name}'s nodes are linked "
                          "pairwise already (tiers.intra_node.link); derive from the switched profile it came from")
    if dpn > dpn_base:
        raise ConfigError(f"--devices-per-node: {dpn} but {base_name}'s nodes have {dpn_base}; its intra-node "
                          f"figures hold for up to {dpn_base} devices: write a profile for larger nodes")
    if dpn != dpn_base:
        out["devices_per_node"] = dpn
        out.pop("topology", None)  # a measured rank -> node map of the base's nodes
        was = sources.get("devices_per_node")
        sources["devices_per_node"] = f"derived: {dpn} (base {base_name}: {dpn_base})"
        if was:
            sources["devices_per_node"] += f"; base: {was}"
        changes.append(f"{dpn} devices a node (base: {dpn_base})")
    if nics_per_node is not None and nics_per_node > MAX_NICS_A_DEVICE * dpn:
        raise ConfigError(f"--nics-per-node: {nics_per_node} is more than {MAX_NICS_A_DEVICE} a device "
                          f"({MAX_NICS_A_DEVICE * dpn} for {dpn}); give at most that (shipped nodes have one a device)")
    if nic_gbps is not None or nics_per_node is not None:
        inter = base.get("tiers", {}).get("inter_node", {})
        if "bandwidth_bytes_per_s" not in inter:
            raise ConfigError(f"--nic-gbps: {base_name} does not say its inter-node bandwidth "
                              "(tiers.inter_node.bandwidth_bytes_per_s, each device's share); add it to derive from it")
        old = _share_gbps(inter["bandwidth_bytes_per_s"])
        if nic_gbps is None and base.get("kind") == "derived":
            raise ConfigError(f"--nic-gbps: {base_name} is derived, its share of {old:g} Gb/s a device need not "
                              "be one NIC's rate; give the NICs' rate with --nics-per-node")
        nic = nic_gbps if nic_gbps is not None else old  # the base: one NIC a device (planner.cluster)
        nics = nics_per_node or dpn
        new = nic * nics / dpn
        scale = new / old
        link = f"{nics} x {nic:g} Gb/s NICs a node of {dpn} devices"
        out["tiers"]["inter_node"] = {"link": link, "bandwidth_bytes_per_s": new * 1e9 / 8}
        sources["tiers.inter_node.bandwidth_bytes_per_s"] = (
            f"derived: {link}, {new:g} Gb/s a device (base {base_name}: {old:g} Gb/s a device, "
            f"{inter.get('link', '')})")
        if scale != 1:
            for op in COLLECTIVES:
                _scale_tier(out["collectives"][op]["inter_node"], scale, f"collectives.{op}.inter_node", sources)
        changes.append(f"inter-node: {link}, {new:g} Gb/s a device" +
                       (f"; every inter-node bus bandwidth x {scale:.4g}" if scale != 1 else " (as the base)"))
    elif dpn != dpn_base:
        changes.append("each device keeps its inter-node share")
    if mesh:
        if dpn < 2:
            raise ConfigError(f"--nvlink-mesh: {base_name if dpn == dpn_base else 'the derived profile'}'s nodes hold "
                              "one device, with no links between devices; give --devices-per-node 2 or more")
        _mesh(out, dpn, sources)
        changes.append(f"devices linked pairwise, no switch: a group of k in a node at (k - 1) / {dpn - 1} "
                       "of the base's intra-node bus bandwidth")
    if memory_gib is not None:
        old_gib = base["device"]["memory_bytes"] / GiB
        out["device"]["memory_bytes"] = int(round(memory_gib * GiB))
        out["device"]["name"] = f"{base['device'].get('name', 'device')} with {memory_gib:g} GiB"
        sources["device.memory_bytes"] = f"derived: {memory_gib:g} GiB (base {base_name}: {old_gib:g} GiB)"
        changes.append(f"device memory {memory_gib:g} GiB (base: {old_gib:g})")
    out["name"] = name
    out["kind"] = "derived"
    out["description"] = f"{'; '.join(changes)}; derived from {base_name}: {base.get('description', '')}"
    sources["derived"] = (f"`trident cluster derive` from {base_name} ({base_hash}): {'; '.join(changes)}. "
                          "Inter-node bus bandwidth scales with each device's share of the node's NICs "
                          "(planner/cluster_cli.py); the rest is the base's")
    return out, changes


def _scale_tier(ab: dict, scale: float, where: str, sources: dict) -> None:
    """Scale every bus bandwidth of one collective's tier; note each field's derivation."""
    def note(field: str):
        base = sources.get(f"{where}.{field}", "")
        sources[f"{where}.{field}"] = f"derived: the base's x {scale:.4g}" + (f"; base: {base}" if base else "")
    ab["bus_bandwidth_bytes_per_s"] *= scale
    note("bus_bandwidth_bytes_per_s")
    if "bus_bandwidth_by_size" in ab:
        ab["bus_bandwidth_by_size"] = [[s, bw * scale] for s, bw in ab["bus_bandwidth_by_size"]]
        note("bus_bandwidth_by_size")
    for v in (ab.get("by_group_size") or {}).values():
        v["bus_bandwidth_bytes_per_s"] *= scale
        for seg in v.get("segments", []):
            seg["bus_bandwidth_bytes_per_s"] *= scale
    if ab.get("by_group_size"):
        note("by_group_size")


def _mesh(out: dict, dpn: int, sources: dict) -> None:
    """The intra-node figures of a node of `dpn` devices linked pairwise (module doc)."""
    tier = out["tiers"].setdefault("intra_node", {})
    tier["link"] = f"NVLink, each pair of a node's {dpn} devices {MESH_LINK} (base: {tier.get('link', '')})"
    share = lambda k: (k - 1) / (dpn - 1)  # noqa: E731 - a group of k's part of a device's links
    for op in COLLECTIVES:
        ab, where = out["collectives"][op]["intra_node"], f"collectives.{op}.intra_node"
        flat = ab["bus_bandwidth_bytes_per_s"]
        if op == "send_recv":  # one pair
            ab["bus_bandwidth_bytes_per_s"] = flat * share(2)
            key = f"{where}.bus_bandwidth_bytes_per_s"
            sources[key] = f"derived: the base's x 1/{dpn - 1}, one pair's links; base: {sources.get(key, '')}"
            continue
        if "bus_bandwidth_by_size" in ab:
            ab["bus_bandwidth_by_size"] = [[s, min(bw, flat)] for s, bw in ab["bus_bandwidth_by_size"]]
            sources[f"{where}.bus_bandwidth_by_size"] = (f"derived: the base's, capped at its flat {flat / 1e9:g} GB/s "
                                                         "(no NVSwitch, no NVLink SHARP); base: "
                                                         f"{sources.get(where + '.bus_bandwidth_by_size', '')}")
        groups = {int(n): v for n, v in (ab.get("by_group_size") or {}).items() if int(n) <= dpn}
        for k in range(2, dpn):
            groups.setdefault(k, {"alpha_s": ab["alpha_s"], "bus_bandwidth_bytes_per_s": flat})
        for k, v in groups.items():
            v["bus_bandwidth_bytes_per_s"] *= share(k)
            for seg in v.get("segments", []):
                seg["bus_bandwidth_bytes_per_s"] *= share(k)
        ab["by_group_size"] = {str(k): groups[k] for k in sorted(groups)}
        if groups:
            sources[f"{where}.by_group_size"] = (f"derived: a group of k devices of a node at (k - 1)/{dpn - 1} of the "
                                                 "base's bus bandwidth for k (its flat figure where it gives none): "
                                                 "k - 1 of each device's link bundles")


def cmd_derive(args) -> int:
    path, base, digest = read_profile(args.base, PROFILE_DIR, "cluster derive")
    cluster_from_dict(base, source=str(path))  # the base must be a valid profile
    out_path = Path(args.output)
    if out_path.resolve() == path.resolve():
        raise ConfigError(f"-o: {out_path} is the base profile; write the derived one to another file")
    if out_path.exists() and out_path.resolve().parent == PROFILE_DIR.resolve():
        raise ConfigError(f"-o: {out_path} is a shipped profile; write the derived one to another file")
    name = args.name or out_path.stem
    derived, changes = derive(base, path.stem, digest, name, nic_gbps=args.nic_gbps, nics_per_node=args.nics_per_node,
                              devices_per_node=args.devices_per_node, memory_gib=args.memory_gib,
                              mesh=args.nvlink_mesh)
    cluster_from_dict(derived, source=str(out_path))  # what is written reads back
    try:
        out_path.write_text(json.dumps(derived, indent=1) + "\n")
    except OSError as exc:
        raise ConfigError(f"-o: cannot write {out_path} ({exc.strerror})") from None
    print(f"wrote {out_path} ({name}): {path.stem} with {'; '.join(changes)}")
    print(f"use it with --cluster {out_path}")
    return 0


def cmd_show(args) -> int:
    path, data, digest = read_profile(args.profile, PROFILE_DIR, "cluster show")
    c = cluster_from_dict(data, source=str(path))
    print(show(c, digest))
    return 0


def show(c, digest: str = "") -> str:
    """A readable summary: the device, the tiers, and each collective's time on 256 MiB."""
    import pandas as pd
    dv, dpn = c.device, c.devices_per_node
    lines = [f"{c.name} ({c.kind}){': ' + c.description if c.description else ''}"]
    if digest:
        lines.append(f"  {digest}")
    peak = ", ".join(f"{k} {v / 1e12:g}" for k, v in dv.peak_flops.items())
    eff = ", ".join(f"{k} {v:g}" for k, v in dv.matmul_efficiency.items())
    lines += [f"device: {dv.name}, {dv.memory_bytes / GiB:.2f} GiB, {dpn} a node",
              f"  peak TFLOP/s: {peak}; matmul efficiency: {eff}",
              f"  memory bandwidth {dv.memory_bandwidth_bytes_per_s / 1e12:.3g} TB/s "
              f"x {dv.memory_bandwidth_efficiency:g}",
              f"  compute beside a collective: {c.overlap_slowdown:g}x as long (overlap_slowdown)"]
    for tier in TIERS:
        t = c.tiers.get(tier)
        if t:
            bw = f", {t['bandwidth_bytes_per_s'] / 1e9:g} GB/s a device" if "bandwidth_bytes_per_s" in t else ""
            lines.append(f"{tier}: {t.get('link', '')}{bw}")
    size, nodes = 256 * 2**20, 8
    rows = []
    for op in COLLECTIVES:
        row = {"collective": op}
        for tier in TIERS:
            alpha, busbw = c.collectives[op][tier].at(dpn if tier == "intra_node" else nodes, size)
            row[f"{tier} alpha us"] = f"{alpha * 1e6:.3g}"
            row[f"{tier} busbw GB/s"] = f"{busbw / 1e9:.4g}"
        one, across = ((2, 1, 2), (2, 2, 1)) if op == "send_recv" else ((dpn, 1, dpn), (nodes * dpn, nodes, dpn))
        row["in a node, ms"] = f"{c.shaped_collective_time(op, size, one) * 1e3:.3g}"
        row[f"across {nodes} nodes, ms"] = f"{c.shaped_collective_time(op, size, across) * 1e3:.3g}"
        rows.append(row)
    lines.append("")
    lines.append(pd.DataFrame(rows).to_string(index=False))
    lines.append(f"(256 MiB: bus bandwidth at that size, and the collective's time over the {dpn} devices of a "
                 f"node and over every device of {nodes} nodes; send_recv: one pair, in a node and on two nodes)")
    return "\n".join(lines)


def register(sub) -> None:
    """The `cluster` subcommand and its two actions."""
    c = sub.add_parser("cluster", help="show a cluster profile, or derive a what-if one "
                                       "(`cluster derive BASE --nic-gbps 200 -o F`)")
    act = c.add_subparsers(dest="action", required=True)
    s = act.add_parser("show", help="what a profile says: device, links, collective costs")
    s.add_argument("profile", help="shipped profile name or a profile JSON path")
    s.set_defaults(func=cmd_show)
    d = act.add_parser("derive", help="write a profile that differs from BASE in network, node size, links or memory")
    d.add_argument("base", help="shipped profile name or a profile JSON path")
    d.add_argument("-o", "--output", type=nonempty, required=True,
                   help="the derived profile's path (use with --cluster)")
    d.add_argument("--name", type=profile_name, help="the profile's name (default: the output file's stem)")
    d.add_argument("--nic-gbps", type=number_in(0.001, 1e6, " Gb/s"), help="line rate of each inter-node NIC, Gb/s")
    d.add_argument("--nics-per-node", type=positive_int,
                   help="inter-node NICs a node (default: one per device)")
    d.add_argument("--devices-per-node", type=positive_int, help="devices a node (at most the base's)")
    d.add_argument("--memory-gib", type=number_in(0.001, 1e6, " GiB"), help="each device's memory, GiB")
    d.add_argument("--nvlink-mesh", action="store_true",
                   help="devices linked pairwise in a node, no NVSwitch (4-GPU HGX boards, NVL bridges)")
    d.set_defaults(func=cmd_derive)
