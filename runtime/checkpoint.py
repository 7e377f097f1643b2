"""Checkpoints with torch.distributed.checkpoint (DCP): model, optimizer, step, data position.

Layout: DIR/step-K/ holds the DCP shards plus `trident.json` ({plan_hash, step, data}). A save is
written to DIR/step-K.tmp and renamed once every rank has finished, so a directory named step-K
is always complete; `trident.json` is what a resume checks before touching anything.
"""
from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from planner.model import ConfigError

META = "trident.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def read_meta(ckpt: Path, plan_hash: str) -> dict:
    """The checkpoint's trident.json, checked against the plan; ConfigError names the file."""
    meta_path = ckpt / META
    try:
        meta = json.loads(meta_path.read_text())
        step = int(meta["step"])
        next_step = int(meta["data"]["next_step"])
        saved_hash = meta["plan_hash"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"checkpoint {meta_path}: unreadable or corrupt ({type(exc).__name__}: {exc}); "
                          "delete that checkpoint or resume from another directory") from None
    if saved_hash != plan_hash:
        raise ConfigError(f"checkpoint {meta_path}: written by a different plan ({saved_hash[:19]}..., this "
                          f"plan is {plan_hash[:19]}...); resume with the plan that wrote it or use another "
                          "--checkpoint-dir")
    return {**meta, "step": step, "next_step": next_step}


def _state(chunks, optimizers, stage_ids) -> dict:
    state = {}
    for chunk, opt, sid in zip(chunks, optimizers, stage_ids):
        state[f"model{sid}"] = get_model_state_dict(chunk)
        state[f"optim{sid}"] = get_optimizer_state_dict(chunk, opt)
    return state


def save(root: str | Path, step: int, chunks, optimizers, stage_ids, plan_hash: str, data_state: dict) -> Path:
    root = Path(root)
    final, tmp = root / f"step-{step}", root / f"step-{step}.tmp"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    dcp.save(_state(chunks, optimizers, stage_ids), checkpoint_id=str(tmp))
    dist.barrier()
    if dist.get_rank() == 0:
        (tmp / META).write_text(json.dumps({"plan_hash": plan_hash, "step": step, "data": data_state}, indent=2))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    dist.barrier()
    return final


def load(ckpt: Path, chunks, optimizers, stage_ids) -> None:
    """Load a checkpoint whose trident.json was already checked into the (parallelized) chunks."""
    state = _state(chunks, optimizers, stage_ids)
    logging.disable(logging.WARNING)  # DCP logs a traceback on the root logger before it raises
    try:
        dcp.load(state, checkpoint_id=str(ckpt))
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP wraps per-rank failures
        msg = [line for line in str(exc).strip().splitlines() if line.strip()]
        raise ConfigError(f"checkpoint {ckpt}: cannot be loaded ({type(exc).__name__}: "
                          f"{msg[-1] if msg else ''}); it is corrupt or was written by other code") from None
    finally:
        logging.disable(logging.NOTSET)
    for chunk, opt, sid in zip(chunks, optimizers, stage_ids):
        set_model_state_dict(chunk, state[f"model{sid}"])
        set_optimizer_state_dict(chunk, opt, state[f"optim{sid}"])
