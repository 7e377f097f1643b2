"""Checkpoints with torch.distributed.checkpoint (DCP): model, optimizer, step, data position.

Layout: DIR/step-K/ holds the DCP shards plus `trident.json` ({plan_hash, run, mesh, layout, step,
data}). A save is written to DIR/step-K.tmp and renamed once every rank has finished, so a
directory named step-K is always complete; `trident.json` is what a resume checks before touching
anything.

The state is keyed by parameter name (the model's `layers.<global index>...` names, whatever stage
holds the layer; AdamW's state flattened to one key per parameter and value), not by pipeline
stage, and every tensor is saved with its global shape: DCP reads each rank's slice of it on load.
So a checkpoint resumes under any plan of the same run (the same model and the training settings
of RUN_FIELDS), with other degrees, stages, ZeRO levels, recomputation or micro-batches, as
torchtitan's does: re-plan for a cluster that grew, shrank or lost a node, and go on. A checkpoint
of trident before 2026-12-04 (keyed by stage id, no `layout`) is refused: resume it with that trident.
"""
from __future__ import annotations

import contextlib
import json
import logging
import re
import shutil
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from planner.model import ConfigError
from planner.values import is_int, is_real
from runtime.optim import reset_weight_decay
from runtime.run_checks import RUN_FIELDS, RUN_FIELDS_ADDED, plan_field
from runtime.parallelize import holds_tied_pair
from runtime.tied import EMBEDDING, head_weight

META = "trident.json"
BY_NAME = "by-name"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def run_of(plan) -> dict:
    """The model (its name aside) and the training settings that a resumed plan must share."""
    model = {k: v for k, v in plan.model.to_dict().items() if k != "name"}
    return {"model": model, "training": {k: getattr(plan.training, k) for k in RUN_FIELDS}}


def mesh_of(plan) -> str:
    m, st = plan.mesh, plan.pipeline.stages
    return (f"pp {m.pp} dp {m.dp}" + (f" ({m.dp_replicate} replicas)" if m.dp_replicate > 1 else "")
            + f" tp {m.tp}" + (f" cp {m.cp}" if m.cp > 1 else "")
            + f", {len(st)} stage{'s' * (len(st) > 1)}, ZeRO {'/'.join(sorted({str(s.zero) for s in st}))}")


def checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def read_meta(ckpt: Path, plan, allowed: tuple = ()) -> dict:
    """The checkpoint's trident.json, checked against the plan (ConfigError names the file and the
    first setting that differs, unless `allowed`: training settings that may, --allow-change);
    `replanned` is true where another plan wrote it, `changed` maps each setting allowed to differ
    that does to its (checkpoint's, plan's) values."""
    meta_path = ckpt / META
    try:
        meta = json.loads(meta_path.read_text())
        step, next_step, scale = meta["step"], meta["data"]["next_step"], meta["data"].get("loss_scale")
        saved_hash = meta["plan_hash"]
        if not (is_int(step) and is_int(next_step) and 0 <= next_step <= step + 1):
            raise ValueError(f"step {step!r} and data.next_step {next_step!r} are not the step counts it writes")
        if scale is not None and not (isinstance(scale, dict) and is_real(scale.get("scale")) and scale["scale"] > 0
                                      and is_int(scale.get("good_steps")) and scale["good_steps"] >= 0):
            raise ValueError(f"data.loss_scale {scale!r} is not a positive scale and a count of good steps")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"checkpoint {meta_path}: unreadable or corrupt ({type(exc).__name__}: {exc}); "
                          "delete that checkpoint or resume from another directory") from None
    if meta.get("layout") != BY_NAME:
        raise ConfigError(f"checkpoint {meta_path}: written by trident before 2026-12-04 (its state keyed by "
                          "pipeline stage); resume it with that trident or use another --checkpoint-dir")
    replanned, changed = saved_hash != plan.content_hash(), {}
    if replanned:
        saved, ours = meta.get("run") or {}, run_of(plan)
        for section, fields in ours.items():
            for k, v in fields.items():
                old = (saved.get(section) or {}).get(k, RUN_FIELDS_ADDED.get(k))
                if old == v:
                    continue
                if section == "training" and k in allowed:
                    changed[plan_field(k)] = (old, v)
                    continue
                hint = f", pass --allow-change {plan_field(k)} to go on with {v!r}" if section == "training" else ""
                raise ConfigError(f"checkpoint {meta_path}: written by a plan with {section}.{plan_field(k)}={old!r}, "
                                  f"this plan has {v!r}; set it to {old!r} (a checkpoint resumes under plans of the "
                                  f"same model and training settings){hint} or use another --checkpoint-dir")
    return {**meta, "step": step, "next_step": next_step, "replanned": replanned, "changed": changed}


def _state(chunks, optimizers, saving: bool = False) -> tuple[dict, list]:
    """The state of this rank's chunks for DCP, and each chunk's (model keys, optimizer keys). A
    saved tied embedding and head that are one parameter (one stage holds both) have the optimizer
    state of the embedding's name only: it is saved under the head's too, for plans whose head
    keeps a copy (runtime.tied)."""
    state, keys = {"model": {}, "optim": {}}, []
    for chunk, opt in zip(chunks, optimizers):
        model, optim = get_model_state_dict(chunk), get_optimizer_state_dict(chunk, opt, options=_FLAT)
        state["model"].update(model)
        state["optim"].update(optim)
        keys.append((list(model), list(optim)))
        if saving and holds_tied_pair(chunk):
            emb, head = f".{EMBEDDING}.", f".{head_weight(chunk.cfg)}."
            state["optim"].update({k.replace(emb, head): v for k, v in optim.items() if emb in k})
    return state, keys


@contextlib.contextmanager
def _failing_as(tmp: Path):
    """A save's failure (a full disk, a directory it cannot write) as one line naming it."""
    try:
        yield
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP wraps per-rank failures
        msg = [line for line in str(exc).strip().splitlines() if line.strip()]
        raise ConfigError(f"--checkpoint-dir: writing {tmp} failed ({type(exc).__name__}: {msg[-1] if msg else ''}); "
                          "free space or choose another directory") from None


class Saver:
    """Writes a run's checkpoints under --checkpoint-dir: every --checkpoint-every steps, or with
    0 once, after the last step. Each is written to step-N.tmp and renamed step-N once complete,
    its trident.json last, so an interrupted save is never resumed from. With --async-checkpoint
    the state is copied to host memory at the step and written by a background thread
    (dcp.async_save over a gloo group of its own, as torchtitan's async mode does) while training
    goes on; the checkpoint is completed at the next save or at the end of the run."""

    def __init__(self, args, device_type: str = "cpu"):
        self.root, self.every, self.last = args.checkpoint_dir, args.checkpoint_every, args.steps
        self.keep = getattr(args, "keep_checkpoints", 0)  # the newest K complete ones (0: all)
        self.group = dist.new_group(backend="gloo") if self.root and getattr(args, "async_checkpoint", False) else None
        if self.group is not None and device_type == "cpu" and dist.get_rank() == 0:
            print("note: --async-checkpoint on CPU: the writes compete with training for the same cores (on this "
                  "project's 2-core host they cost more than saving at once: benchmarks/async_checkpoint.py)", flush=True)
        self.pending = None  # (future or None, tmp, final, meta) of a save to complete

    def due(self, step: int) -> bool:
        """Whether to save after step `step` (0-based)."""
        if not self.root:
            return False
        return (step + 1) % self.every == 0 if self.every else step + 1 == self.last

    def save(self, step: int, chunks, optimizers, plan, data_state: dict) -> None:
        self.finish()
        root = Path(self.root)
        final, tmp = root / f"step-{step}", root / f"step-{step}.tmp"
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        state = _state(chunks, optimizers, saving=True)[0]
        meta = {"plan_hash": plan.content_hash(), "layout": BY_NAME, "run": run_of(plan), "mesh": mesh_of(plan),
                "step": step, "data": data_state}
        future = None
        with _failing_as(tmp):
            if self.group is None:
                dcp.save(state, checkpoint_id=str(tmp))
            else:
                future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self.group)
        self.pending = (future, tmp, final, meta)
        if future is None:
            self.finish()

    def finish(self) -> None:
        """Complete the save under way (every rank): wait for its writes, then rank 0 writes
        trident.json and renames step-N.tmp to step-N."""
        if self.pending is None:
            return
        future, tmp, final, meta = self.pending
        self.pending = None
        if future is not None:
            with _failing_as(tmp):
                future.result()
        dist.barrier()
        if dist.get_rank() == 0:
            (tmp / META).write_text(json.dumps(meta, indent=2))
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            if self.keep:  # the oldest beyond K in all, never the one just completed
                others = [p for p in checkpoints(final.parent) if p != final]  # oldest first
                for old in others[:max(0, len(others) + 1 - self.keep)]:
                    shutil.rmtree(old)
        dist.barrier()


def load(ckpt: Path, chunks, optimizers) -> None:
    """Load a checkpoint whose trident.json was already checked (read_meta) into the
    (parallelized) chunks, each rank reading its slices of the saved tensors."""
    state, keys = _state(chunks, optimizers)
    logging.disable(logging.WARNING)  # DCP logs a traceback on the root logger before it raises
    try:
        dcp.load(state, checkpoint_id=str(ckpt))
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP wraps per-rank failures
        msg = [line for line in str(exc).strip().splitlines() if line.strip()]
        raise ConfigError(f"checkpoint {ckpt}: cannot be loaded ({type(exc).__name__}: "
                          f"{msg[-1] if msg else ''}); it is corrupt or was written by other code") from None
    finally:
        logging.disable(logging.NOTSET)
    for chunk, opt, (model_keys, optim_keys) in zip(chunks, optimizers, keys):
        set_model_state_dict(chunk, {k: state["model"][k] for k in model_keys})
        set_optimizer_state_dict(chunk, opt, {k: state["optim"][k] for k in optim_keys}, options=_FLAT)


def shard_metadata(ckpt: Path, fix: str):
    """The DCP metadata of checkpoint `ckpt` (its `.metadata`), once every tensor file it names is
    there and at least as long as the byte ranges it records in that file: a torn copy or an
    interrupted write, found without reading a tensor. ConfigError (one line, ending in `fix`) where
    not; `trident export` and --resume (to_resume) ask, before any process reads the tensors."""
    try:
        meta = dcp.FileSystemReader(str(ckpt)).read_metadata()
        ends: dict[str, int] = {}
        for info in meta.storage_data.values():
            ends[info.relative_path] = max(ends.get(info.relative_path, 0), int(info.offset) + int(info.length))
    except Exception as exc:  # noqa: BLE001 (a torn or foreign .metadata: unpickling fails in many ways)
        raise ConfigError(f"checkpoint {ckpt}: its .metadata cannot be read ({type(exc).__name__}); the checkpoint "
                          f"is incomplete or corrupt: {fix}") from None
    for name, end in sorted(ends.items()):
        f = ckpt / name
        size = f.stat().st_size if f.is_file() else None
        if size is None or size < end:
            held = "is missing" if size is None else f"holds {size:,} bytes where its .metadata records {end:,}"
            raise ConfigError(f"checkpoint {ckpt}: its tensor file {name} {held}; the checkpoint is incomplete or "
                              f"corrupt: {fix}")
    return meta


def to_resume(args, plan, allowed: tuple = ()) -> tuple[Path, dict] | None:
    """The newest checkpoint under --checkpoint-dir that --resume continues from, with its checked
    trident.json (read_meta; `allowed`: --allow-change's fields); None where the run starts at step
    0. ConfigError where it cannot start: a checkpoint there without --resume, one at --steps
    already, or one whose tensor files are torn (shard_metadata). runtime.run_checks asks before
    `trident run` launches the ranks, which ask again."""
    found = checkpoints(args.checkpoint_dir) if args.checkpoint_dir else []
    if found and not args.resume:
        raise ConfigError(f"--checkpoint-dir: {args.checkpoint_dir} already holds {found[-1].name}; pass --resume "
                          "to continue from it or choose an empty directory")
    if not found:
        return None
    meta = read_meta(found[-1], plan, allowed)
    if meta["next_step"] >= args.steps:
        raise ConfigError(f"--steps: {args.steps}, but {found[-1]} already reached step {meta['next_step']}; "
                          "ask for more steps")
    before = f"resume {found[-2].name}" if len(found) > 1 else "start from step 0"
    shard_metadata(found[-1], f"delete {found[-1].name} to {before}, or use another --checkpoint-dir")
    return found[-1], meta


def resume(args, plan, trainer, rank: int) -> int:
    """The step to start from: 0, or the next step of the latest checkpoint under --checkpoint-dir
    (--resume), loaded into the trainer's chunks and optimizers."""
    got = to_resume(args, plan, getattr(args, "allow_change", ()))
    if got is None:
        if args.checkpoint_dir and args.resume and rank == 0:
            print(f"no checkpoint in {args.checkpoint_dir}; starting from step 0", flush=True)
        return 0
    ckpt, meta = got
    load(ckpt, trainer.chunks, trainer.optimizers)
    reset_weight_decay(trainer.optimizers, plan.training.weight_decay)
    trainer.scaler.load(meta["data"].get("loss_scale"))  # fp16's loss scale where it was saved
    if meta["replanned"] and rank == 0:
        print(f"resumed {ckpt.name} of another plan of this run ({meta.get('mesh', '?')}; now "
              f"{mesh_of(plan)}): its model and optimizer state resharded to this plan", flush=True)
    if meta["changed"] and rank == 0:
        print("resumed with changed training settings (--allow-change): " + ", ".join(
            f"{k} {old!r} -> {new!r}" for k, (old, new) in meta["changed"].items()), flush=True)
    return meta["next_step"]
