"""Input checks shared by the cluster-profile and model loaders: reading a JSON file, finite
numbers, known keys, and the parts of a cluster profile whose checks span several fields
(topology.node_of_rank, by_group_size segments). Every failure is a one-line ConfigError that
names the field and the fix."""
from __future__ import annotations

import json
import math
import stat
from collections import Counter
from pathlib import Path

from planner.model import ConfigError, is_int

# what a cluster profile holds at the top level: planner.cluster reads the first ones; `tiers`
# (link descriptions), `sources` (where each number comes from) and `sweep` (the raw points of
# `trident profile cluster`, runtime/profile.py) document the file
PROFILE_KEYS = ("format_version", "name", "description", "kind", "backend", "devices_per_node", "nodes", "device",
                "collectives", "topology", "overlap_slowdown", "compute_slots", "tiers", "sources", "sweep")


MAX_INPUT_BYTES = 1 << 30  # a plan, profile or run record; larger is not one (and would fill memory)


def read_input(path, flag: str) -> bytes:
    """The bytes of a regular file of at most MAX_INPUT_BYTES: a FIFO would block the read and a
    device such as /dev/zero never end, so neither is read; a one-line ConfigError naming `flag`."""
    path = Path(path)
    try:
        st = path.stat()
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):  # a directory: read_bytes says so
            raise ConfigError(f"{flag}: {path} is not a regular file; give a JSON file")
        if st.st_size > MAX_INPUT_BYTES:
            raise ConfigError(f"{flag}: {path} is over {MAX_INPUT_BYTES >> 30} GiB; give a JSON file")
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{flag}: cannot read {path} ({exc.strerror or exc}); give a JSON file") from None


class DuplicateKey(ValueError):
    """A JSON object naming one key twice: Python's json keeps the last silently."""


def _one_of_each(pairs: list) -> dict:
    out = dict(pairs)
    if len(out) < len(pairs):  # a key given twice (looked for only then: every object of every file passes here)
        twice = next(k for k, n in Counter(k for k, _ in pairs).items() if n > 1)
        raise DuplicateKey(f"the key {twice!r} appears twice in one object; keep one of them")
    return out


def parse_json(text):
    """json.loads, refusing an object that names a key twice (DuplicateKey, a ValueError)."""
    return json.loads(text, object_pairs_hook=_one_of_each)


def read_json(path: Path, flag: str) -> tuple[bytes, object]:
    """(bytes, parsed JSON) of the file at `path`; a one-line ConfigError naming `flag` otherwise."""
    raw = read_input(path, flag)
    try:
        data = parse_json(raw)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{flag}: {path} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    except DuplicateKey as exc:
        raise ConfigError(f"{flag}: {path}: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{flag}: {path} is not UTF-8 text ({exc.reason} at byte {exc.start}); "
                          "save it as UTF-8 JSON") from None
    except (ValueError, RecursionError) as exc:
        raise ConfigError(f"{flag}: {path} is not valid JSON ({unreadable(exc)})") from None
    check_finite(data, f"{flag}: {path}")
    return raw, data


def unreadable(exc: Exception) -> str:
    """Why json.loads refused a text that is JSON in form: Python's own limits."""
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    if isinstance(exc, DuplicateKey):
        return str(exc)
    return "an integer of over 4300 digits" if "digits" in str(exc) else type(exc).__name__


def check_finite(v, source: str, where: str = "") -> None:
    """Every value of a parsed JSON document is one trident can use: numbers finite and integers
    below 2^64 (Python's json reads NaN, Infinity and integers of any length), strings and keys
    Unicode text (it reads a lone surrogate such as \\ud800 too, which cannot be printed)."""
    if isinstance(v, float) and not math.isfinite(v):
        raise ConfigError(f"{source}: {where}: {v} is not a finite number; give a real value "
                          "(NaN and Infinity are refused)")
    if is_int(v) and abs(v) > MAX_INT:
        raise ConfigError(f"{source}: {where}: an integer of {len(str(abs(v)))} digits is out of range; "
                          f"give a value below 2^64")
    if isinstance(v, str) and not _text(v):
        raise ConfigError(f"{source}: {where}: {ascii(v)[:60]} is not Unicode text (a lone surrogate); "
                          "give the string as UTF-8 text")
    if isinstance(v, dict):
        for k, x in v.items():
            if isinstance(k, str) and not _text(k):
                raise ConfigError(f"{source}: {where or 'the top level'}: the key {ascii(k)[:60]} is not Unicode "
                                  "text (a lone surrogate); give the key as UTF-8 text")
            check_finite(x, source, f"{where}.{k}" if where else str(k))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            check_finite(x, source, f"{where}[{i}]")


def decimal(key) -> bool:
    """A key that is a whole number in ASCII digits (str.isdigit also takes '²', which int() refuses)."""
    return isinstance(key, str) and key.isascii() and key.isdigit()


MAX_INT = 2 ** 64 - 1  # the largest unsigned 64-bit integer (a seed); no count or size comes near it


def _text(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


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
