"""The checks of a model profile's JSON (planner.model_profile, as `trident profile model` writes
it): each error is one line naming the field and what it must be. Beyond types, figures are
bounded: a measured time or a fit's coefficient above MAX_SECONDS, a byte count above MAX_BYTES
or more processes than one host runs are not measurements, and would price steps at inf (or
absurdly) further on."""
from __future__ import annotations

import math

from planner.args import MAX_ARG
from planner.cluster import MAX_DEVICES_PER_NODE as MAX_PROCESSES  # the profiling run is one host's
from planner.compare import MAX_STEP_S as MAX_SECONDS
from planner.model import MAX_NAME, RECOMPUTE_MODES, ConfigError, is_int, is_one_line, is_real
from planner.plan import SP_SAVED_INPUTS

MAX_BYTES = 2.0 ** 64
LAYER_KINDS = ("embedding", "block", "head")
DTYPE_NAMES = ("fp32", "bf16", "fp16")
DP_EXTRAS = ("forward_s", "backward_s", "backward_sync_s", "optimizer_s")
# the fields `trident profile model` writes (runtime.profile_model): any other is a typo or another file's
TOP_FIELDS = ("format_version", "name", "model", "seq_len", "dtype", "param_dtype", "sp_saved_inputs", "processes",
              "cluster_profile", "micro_batches", "entries", "pipeline", "sources")
ENTRY_FIELDS = ("layer", "tp", "sequence_parallel", "recompute", "cp", "forward_s", "backward_s", "activation_bytes",
                "optimizer_s", "param_bytes", "grad_bytes", "points", "data_parallel")
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zbv")
PIPELINE_SETUP = ("pp", "micro_batches", "message_bytes", "layer", "block_s")  # runtime.profile_pipeline's run


def is_num(v, high: float = math.inf) -> bool:
    """A finite number (not a bool) of magnitude at most `high`."""
    return is_real(v) and abs(v) <= high


def is_count(v, high: int) -> bool:
    """An integer (not a bool) from 1 to `high`."""
    return is_int(v) and 0 < v <= high


def check_model_profile(d, source: str, format_version: int) -> None:
    """ConfigError "SOURCE: FIELD: what is wrong" for the first wrong field of `d`."""
    def need(cond, fld, msg):
        if not cond:
            raise ConfigError(f"{source}: {fld}: {msg}")

    need(isinstance(d, dict), "profile", "expected a JSON object")
    _known(d, TOP_FIELDS, "", need)
    fv = d.get("format_version")
    need(is_count(fv, format_version) and fv == format_version, "format_version",
         f"{fv!r} is not supported (this trident reads {format_version}); re-run `trident profile model`")
    for key in ("name", "model", "seq_len", "dtype", "cluster_profile", "entries"):
        need(key in d, key, "missing")
    name = d["name"]
    need(is_one_line(name), "name", f"must be a non-empty printable string of one line, at most {MAX_NAME} characters")
    need(is_count(d["seq_len"], MAX_ARG), "seq_len", f"{d['seq_len']!r} must be a positive integer")
    need(d["dtype"] in DTYPE_NAMES, "dtype", f"{d['dtype']!r}; use fp32, bf16 or fp16")
    need(d.get("param_dtype", "fp32") in DTYPE_NAMES, "param_dtype",
         f"{d.get('param_dtype')!r}; use fp32, bf16 or fp16 (the dtype the measured parameters are held in)")
    need(d.get("sp_saved_inputs", "gathered") in SP_SAVED_INPUTS, "sp_saved_inputs",
         f"{d.get('sp_saved_inputs')!r}; use shard or gathered (what sequence parallelism kept when measured)")
    procs = d.get("processes", 1)
    need(is_count(procs, MAX_PROCESSES), "processes",
         f"{procs!r} must be a positive integer, at most {MAX_PROCESSES} (the processes of the profiling run)")
    mbs = d.get("micro_batches", [])
    need(isinstance(mbs, list) and all(is_count(b, MAX_ARG) for b in mbs), "micro_batches",
         f"{mbs!r} must be a list of the positive micro-batch sizes measured")
    cp = d["cluster_profile"]
    need(isinstance(cp, dict) and isinstance(cp.get("name"), str) and isinstance(cp.get("hash", ""), str),
         "cluster_profile", "expected {\"name\": ..., \"hash\": ...}")
    _known(cp, ("name", "hash"), "cluster_profile.", need)
    need(isinstance(d["entries"], list) and d["entries"], "entries", "expected a non-empty list of layer measurements")
    seen = set()
    for i, e in enumerate(d["entries"]):
        key = _check_entry(e, f"entries[{i}]", procs, mbs, need)
        need(key not in seen, f"entries[{i}]", f"duplicates the measurement of {key}")
        seen.add(key)
    pipe = d.get("pipeline", {})
    need(isinstance(pipe, dict), "pipeline", "expected an object of schedule -> {overhead_per_op_s}")
    _known(pipe, PIPELINE_SCHEDULES + PIPELINE_SETUP, "pipeline.", need)
    for sched in (k for k in pipe if k in PIPELINE_SCHEDULES):
        need(isinstance(pipe[sched], dict), f"pipeline.{sched}",
             "expected {\"step_s\": ..., \"overhead_per_op_s\": ...}")
        _known(pipe[sched], ("step_s", "overhead_per_op_s"), f"pipeline.{sched}.", need)
        for fld in ("step_s", "overhead_per_op_s"):
            v = pipe[sched].get(fld, 0.0)
            need(is_num(v, MAX_SECONDS) and v >= 0, f"pipeline.{sched}.{fld}",
                 f"{v!r} must be a non-negative number of seconds, at most {MAX_SECONDS:g}")


def _known(d: dict, fields: tuple, where: str, need) -> None:
    """The first field of `d` not among `fields`, as an error naming it (a typo, or another file)."""
    extra = [k for k in d if k not in fields]
    need(not extra, f"{where}{extra[0] if extra else ''}",
         f"unknown field; {where.rstrip('.') or 'a model profile'} has {', '.join(fields)}")


def _check_entry(e, w: str, procs: int, mbs: list, need) -> tuple:
    """Check one layer measurement; returns its key (layer, tp, sequence parallel, recompute, cp)."""
    need(isinstance(e, dict), w, "expected an object")
    _known(e, ENTRY_FIELDS, f"{w}.", need)
    need(e.get("layer") in LAYER_KINDS, f"{w}.layer", f"{e.get('layer')!r}; use one of {', '.join(LAYER_KINDS)}")
    need(is_count(e.get("tp"), MAX_PROCESSES), f"{w}.tp",
         f"{e.get('tp')!r} must be a positive integer, at most {MAX_PROCESSES}")
    need(isinstance(e.get("sequence_parallel", False), bool), f"{w}.sequence_parallel", "must be true or false")
    cp = e.get("cp", 1)  # a block measured under context parallelism (runtime.profile_model)
    need(is_count(cp, MAX_PROCESSES) and (cp == 1 or e.get("layer") == "block"), f"{w}.cp",
         f"{cp!r} must be a positive integer, at most {MAX_PROCESSES}, and above 1 only for a block")
    rec = e.get("recompute", "none")
    low, top = (min(mbs), max(mbs)) if mbs else (1, 1)  # the micro-batches measured (mbs: checked before)
    need(rec in RECOMPUTE_MODES, f"{w}.recompute", f"{rec!r}; use one of {', '.join(RECOMPUTE_MODES)}")
    for fld, high in (("forward_s", MAX_SECONDS), ("backward_s", MAX_SECONDS), ("activation_bytes", MAX_BYTES)):
        v = e.get(fld)
        need(isinstance(v, list) and len(v) == 2 and all(is_num(x, high) for x in v), f"{w}.{fld}",
             f"{v!r} must be a fit [a, b] of a + b * micro_batch, each at most {high:g} in size")
        # a least-squares line through times measured (not negative) passes through their mean, so it is
        # not negative at both ends of the micro-batches measured (1 where none is listed); a noisy one
        # may be at one end, which pricing clamps to 0. A heap's activation count may dip below zero by
        # what other threads freed meanwhile (runtime.profile_model)
        need(fld == "activation_bytes" or max(v[0] + v[1] * low, v[0] + v[1] * top) >= 0, f"{w}.{fld}",
             f"{v!r} is negative at the micro-batches measured ({low} to {top}): not a measurement")
    pts = e.get("points", [])
    need(isinstance(pts, list) and all(isinstance(p, list) and len(p) == 4 and all(is_num(x, MAX_BYTES) for x in p)
                                       and min(p[:3]) >= 0 for p in pts), f"{w}.points",
         "must be a list of [micro_batch, forward_s, backward_s, activation_bytes], the first three not negative")
    need(is_num(e.get("param_bytes"), MAX_BYTES) and e["param_bytes"] > 0, f"{w}.param_bytes",
         f"{e.get('param_bytes')!r} must be a positive number of bytes, at most {MAX_BYTES:g}")
    need(is_num(e.get("grad_bytes"), MAX_BYTES) and e["grad_bytes"] >= 0, f"{w}.grad_bytes",
         f"{e.get('grad_bytes')!r} must be a non-negative number of bytes, at most {MAX_BYTES:g}")
    opt = e.get("optimizer_s", 0.0)
    need(is_num(opt, MAX_SECONDS) and opt >= 0, f"{w}.optimizer_s",
         f"{opt!r} must be a non-negative number of seconds, at most {MAX_SECONDS:g}")
    dpm = e.get("data_parallel", {})
    need(isinstance(dpm, dict), f"{w}.data_parallel", "expected an object")
    for z, v in dpm.items():
        if z in ("dp", "micro_batch"):
            high = procs if z == "dp" else MAX_ARG  # its data-parallel group is of the run's processes
            need(is_count(v, high), f"{w}.data_parallel.{z}", f"{v!r} must be a positive integer, at most {high}")
            continue
        need(z in ("zero0", "zero1", "zero3") and isinstance(v, dict), f"{w}.data_parallel.{z}",
             f"expected zero0, zero1 or zero3 with {', '.join(DP_EXTRAS)}")
        for fld in DP_EXTRAS:
            need(is_num(v.get(fld), MAX_SECONDS) and v[fld] >= 0, f"{w}.data_parallel.{z}.{fld}",
                 f"{v.get(fld)!r} must be a non-negative number of seconds, at most {MAX_SECONDS:g}")
    return e["layer"], e["tp"], bool(e.get("sequence_parallel", False)), rec, cp
