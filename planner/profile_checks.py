"""Input checks shared by the cluster-profile and model loaders: reading a JSON file, finite
numbers, known keys, and the parts of a cluster profile whose checks span several fields
(topology.node_of_rank, by_group_size segments). Every failure is a one-line ConfigError that
names the field and the fix."""
from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

from planner.model import ConfigError, is_int

# what a cluster profile holds at the top level: planner.cluster reads the first ones; `tiers`
# (link descriptions), `sources` (where each number comes from) and `sweep` (the raw points of
# `trident profile cluster`, runtime/profile.py) document the file
PROFILE_KEYS = ("format_version", "name", "description", "kind", "backend", "devices_per_node", "nodes", "device",
                "collectives", "topology", "overlap_slowdown", "compute_slots", "tiers", "sources", "sweep")


def read_json(path: Path, flag: str) -> tuple[bytes, object]:
    """(bytes, parsed JSON) of the file at `path`; a one-line ConfigError naming `flag` otherwise."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{flag}: cannot read {path} ({exc.strerror or exc}); give a JSON file") from None
    try:
        return raw, json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{flag}: {path} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{flag}: {path} is not UTF-8 text ({exc.reason} at byte {exc.start}); "
                          "save it as UTF-8 JSON") from None
    except (ValueError, RecursionError) as exc:
        raise ConfigError(f"{flag}: {path} is not valid JSON ({type(exc).__name__})") from None


def check_finite(v, source: str, where: str = "") -> None:
    """Every number in a parsed JSON document is finite (Python's json reads NaN and Infinity)."""
    if isinstance(v, float) and not math.isfinite(v):
        raise ConfigError(f"{source}: {where}: {v} is not a finite number; give a real value "
                          "(NaN and Infinity are refused)")
    if isinstance(v, dict):
        for k, x in v.items():
            check_finite(x, source, f"{where}.{k}" if where else str(k))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            check_finite(x, source, f"{where}[{i}]")


def check_keys(d: dict, known: tuple, prefix: str) -> None:
    """No key outside `known`; `prefix` comes before the key in the message ("p.json: device.")."""
    unknown = sorted(str(k) for k in d if k not in known)
    if unknown:
        raise ConfigError(f"{prefix}{unknown[0]}: unknown field; known fields are {', '.join(sorted(known))}")


def check_segments(segs: list, where: str) -> None:
    """Piecewise fits by message size (planner.cluster.AlphaBeta.at): each up to a buffer size,
    rising, the last with up_to_bytes null (it covers every larger message)."""
    last = len(segs) - 1
    for k, (up, _, _) in enumerate(segs):
        if k == last and up is not None:
            raise ConfigError(f"{where}[{k}].up_to_bytes: {up:g} on the last segment; make it null "
                              "(the last segment covers every larger message)")
        if k < last and up is None:
            raise ConfigError(f"{where}[{k}].up_to_bytes: null before the last segment; give the largest "
                              "buffer size it covers (only the last segment has null)")
        if 0 < k < last and up <= segs[k - 1][0]:
            raise ConfigError(f"{where}[{k}].up_to_bytes: {up:g} does not rise above segment {k - 1}'s "
                              f"{segs[k - 1][0]:g}; order the segments by size")


def check_node_of_rank(topo, nodes: int | None, per_node: int, where: str) -> list:
    """topology.node_of_rank: a node index per rank, in range, no node holding more ranks than
    devices_per_node, no more ranks than the profile's nodes hold."""
    nor = topo.get("node_of_rank") if isinstance(topo, dict) else None
    if not isinstance(nor, list) or not nor or not all(is_int(x) for x in nor):
        raise ConfigError(f"{where}.node_of_rank: must be a list of node indices (integers from 0), one per rank")
    count, per = nodes if nodes is not None else len(nor), Counter(nor)
    if nodes is not None and len(nor) > nodes * per_node:
        raise ConfigError(f"{where}.node_of_rank: {len(nor)} ranks but nodes={nodes} x devices_per_node="
                          f"{per_node} devices; give one entry per rank")
    for i, x in enumerate(nor):
        if not 0 <= x < count:
            raise ConfigError(f"{where}.node_of_rank[{i}]: {x} is not a node index in 0..{count - 1}; "
                              "number the nodes from 0" + ("" if nodes is not None else " (or set nodes)"))
        if per[x] > per_node:
            raise ConfigError(f"{where}.node_of_rank: node {x} has {per[x]} ranks but devices_per_node "
                              f"is {per_node}; fix the node indices or devices_per_node")
    return nor
