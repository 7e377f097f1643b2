"""runtime.train's command line, and what it checks before its process group starts: the plan
against this launch and what the runtime runs, and the options; ConfigError (one line) on
anything wrong."""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from planner.args import OneLineParser
from planner.model import ConfigError
from planner.plan import Plan, split_backward
from runtime.evaluate import add_eval_args
from runtime.loss_scale import INITIAL, initial_scale


def parse_args(argv=None) -> argparse.Namespace:
    ap = OneLineParser(prog="runtime.train", description="torchrun entry: train a plan (runtime.train)")
    ap.add_argument("--plan", nargs="+", required=True, help="plan.json (several: trained one after another)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--data", default="synthetic",
                    help="synthetic, a uint16/uint32 token file, or a blend FILE:WEIGHT,FILE:WEIGHT (runtime.blend)")
    ap.add_argument("--data-dtype", choices=("uint16", "uint32"), default=None)
    ap.add_argument("--eos-id", type=int, default=None, help="end-of-text id of a document mask (default: the data's)")
    ap.add_argument("--out", default=None, help="run.json (a directory when several plans are given)")
    ap.add_argument("--checkpoint-dir", default=None)
    ap.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints (0: after the last)")
    ap.add_argument("--keep-checkpoints", type=int, default=0, metavar="K",
                    help="keep the newest K checkpoints, deleting older ones as new ones complete (default 0: all)")
    ap.add_argument("--metrics", default=None, metavar="FILE",
                    help="append a JSON line per step (and validation) to FILE as the run goes (rank 0)")
    ap.add_argument("--async-checkpoint", action="store_true", help="write checkpoints while training goes on")
    ap.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --checkpoint-dir")
    ap.add_argument("--allow-change", type=changeable_fields, default=(), metavar="FIELDS",
                    help="training settings (e.g. global_batch,lr) a resumed plan may change from the checkpoint's run")
    ap.add_argument("--force", action="store_true", help="run a plan even if its prediction says it does not fit")
    ap.add_argument("--init-from", default=None, metavar="DIR", help="start from a transformers model's weights")
    ap.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None,
                    help="compute dtype (default: the plan's on GPU, fp32 on CPU)")
    ap.add_argument("--initial-loss-scale", type=initial_scale, default=INITIAL,
                    help=f"fp16: the dynamic loss scale to start from (default {INITIAL:g}; Megatron-LM's --initial-loss-scale)")
    ap.add_argument("--trace", default=None, metavar="DIR",
                    help="profile the last step with torch.profiler: per-rank operator tables and traces in DIR")
    add_eval_args(ap)
    return ap.parse_args(argv)


# what makes two plans one training run: a step of either gives the same loss from the same state
# (the data of step i depends on the seed, the step and the global batch; the learning rate on the step)
RUN_FIELDS = ("global_batch", "seq_len", "dtype", "optimizer", "master_weights", "lr", "weight_decay", "grad_clip",
              "dropout", "attention_dropout_p", "seed", "lr_warmup_steps", "lr_decay", "lr_decay_steps", "min_lr",
              "document_mask", "eod_mask_loss", "reset_position_ids", "moe_aux_loss")
# run fields that checkpoints written before them lack, and the value those ran with (the runtime
# refused dropout and had no document masks before 2026-12-05)
RUN_FIELDS_ADDED = {"attention_dropout_p": 0.0, "document_mask": False, "eod_mask_loss": False,
                    "reset_position_ids": False, "moe_aux_loss": 0.0}


def plan_field(k: str) -> str:
    """A RUN_FIELDS name as the plan spells it (attention_dropout_p: attention_dropout, null: dropout)."""
    return k.removesuffix("_p")


def changeable_fields(text: str) -> tuple[str, ...]:
    """--allow-change: comma-separated training settings of RUN_FIELDS (as the plan names them)."""
    names = {plan_field(k): k for k in RUN_FIELDS}
    picked = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [x for x in picked if x not in names]
    if bad or not picked:
        raise argparse.ArgumentTypeError(f"{text!r}: name training settings among {', '.join(names)}")
    return tuple(names[x] for x in picked)


# plan options that describe other frameworks, for predicting their runs: (field, the value the
# runtime runs, whose engine the other values describe)
PREDICTION_ONLY = (
    ("training.fp8", None, "TransformerEngine's or torchao's FP8 linears (planner.fp8)"),
    ("training.fp8_param_gather", False, "FP8 parameters (Megatron-LM's --fp8-param-gather)"),
    ("training.overlap_grad_reduce", True, "Megatron-LM's local DDP or DeepSpeed's pipeline engine"),
    ("training.overlap_param_gather", True, "DeepSpeed's ZeRO 1 or Megatron-LM's distributed optimizer by default"),
    ("training.async_tp_allreduce", False, "Megatron-LM"),
    ("training.tp_comm_overlap", False, "TransformerEngine's userbuffers or torchtitan's async TP"),
    ("training.grad_accumulation", "separate-fp32", "Megatron-LM or DeepSpeed"),
    ("training.elementwise_kernels", "eager", "Megatron-LM's fused kernels"),
    ("training.fsdp_copies", True, "flat-buffer data parallelism (Megatron-LM's DDP, FSDP1)"),
    ("pipeline.lockstep", False, "DeepSpeed's pipeline engine"),
    ("pipeline.p2p", "full", "Megatron-LM or DeepSpeed"),
    ("pipeline.sent_outputs", "kept", "Megatron-LM's deallocate_output_tensor"),
)



def check_plan(path: str, args: argparse.Namespace, world: int) -> Plan:
    """Read and check a plan against this launch; ConfigError (one line) on anything wrong."""
    plan = Plan.read(path)
    if plan.mesh.world_size != world:
        m = plan.mesh
        raise ConfigError(f"{path}: the plan needs {m.world_size} processes (pp*dp*cp*tp = "
                          f"{m.pp}*{m.dp}*{m.cp}*{m.tp}) but {world} were launched; "
                          f"use torchrun --nproc-per-node {plan.mesh.world_size} (or `trident run`)")
    if plan.prediction and plan.prediction.get("fits") is False and not args.force:
        raise ConfigError(f"{path}: the prediction says this plan does not fit in device memory; "
                          "pick another plan or pass --force to try anyway")
    t = plan.training
    if t.attention != "flash":
        raise ConfigError(f"training.attention: {t.attention} is for predicting other frameworks' runs; the "
                          "runtime runs fused scaled_dot_product_attention, set it to flash to run")
    zero0 = min(s.zero for s in plan.pipeline.stages) == 0
    if plan.mesh.ep > 1 and zero0:
        raise ConfigError(f"mesh.ep: {plan.mesh.ep}: the runtime spreads experts under ZeRO 1-3; set every stage's "
                          "zero to 1-3, or ep to 1")
    if t.dtype != "fp32" and not t.master_weights:
        raise ConfigError("training.master_weights: false describes 16-bit training without a float32 master copy, "
                          "for prediction; the runtime keeps float32 masters (and the plan would under-count their "
                          "memory), set it to true to run")
    for name, runs, who in PREDICTION_ONLY:
        section, field = name.split(".")
        value = getattr(getattr(plan, section), field)
        if value != runs:
            raise ConfigError(f"{name}: {json.dumps(value)} describes {who} for prediction; the runtime runs "
                              f"{json.dumps(runs)}, set it to that to run")
    if t.selective_recompute == "ops" and split_backward(plan.pipeline.schedule, plan.mesh.pp) and any(
            "selective" in s.recompute for s in plan.pipeline.stages):
        raise ConfigError("training.selective_recompute: ops under zbv's split backward would replay each block in I "
                          "and again in W, which the plan prices once; use another schedule, or attention, to run")
    if plan.mesh.pp > 1 and plan.pipeline.schedule == "1f1b" and plan.pipeline.micro_batches < plan.mesh.pp:
        raise ConfigError(f"pipeline.micro_batches: {plan.pipeline.micro_batches} is fewer than pp={plan.mesh.pp}, "
                          "which torch's Schedule1F1B refuses; use gpipe or more micro-batches")
    sp = {s.sequence_parallel for s in plan.pipeline.stages}
    if len(sp) > 1:
        raise ConfigError("pipeline.stages[*].sequence_parallel: the runtime needs the same value on every stage "
                          "(stage boundaries carry sequence-sharded activations under SP)")
    local = t.seq_len // plan.mesh.cp  # a rank's tokens of a sequence (context parallelism: mesh.cp)
    if sp == {True} and local % plan.mesh.tp:
        raise ConfigError(f"training.seq_len: {f'its {local} tokens a CP rank' if plan.mesh.cp > 1 else t.seq_len} "
                          f"{'are' if plan.mesh.cp > 1 else 'is'} not divisible by tp={plan.mesh.tp}, which "
                          "sequence parallelism needs")
    for flag, where in (("--checkpoint-dir", args.checkpoint_dir), ("--trace", getattr(args, "trace", None))):
        check_dir(flag, where)
    if args.checkpoint_every and not args.checkpoint_dir:
        raise ConfigError("--checkpoint-every needs --checkpoint-dir")
    if args.resume and not args.checkpoint_dir:
        raise ConfigError("--resume needs --checkpoint-dir")
    if getattr(args, "allow_change", None) and not args.resume:  # else ignored: no checkpoint's settings to change
        raise ConfigError("--allow-change: only with --resume (it names the training settings a resumed run may "
                          "change from its checkpoint's); add --resume --checkpoint-dir DIR, or leave it out")
    if getattr(args, "async_checkpoint", False) and not args.checkpoint_dir:
        raise ConfigError("--async-checkpoint needs --checkpoint-dir")
    if args.steps < 1:
        raise ConfigError(f"--steps: {args.steps} must be at least 1")
    if getattr(args, "metrics", None):
        check_out_file("--metrics", args.metrics, "metrics.jsonl")
    if getattr(args, "keep_checkpoints", 0) and not args.checkpoint_dir:
        raise ConfigError("--keep-checkpoints needs --checkpoint-dir")
    if getattr(args, "keep_checkpoints", 0) < 0:
        raise ConfigError(f"--keep-checkpoints: {args.keep_checkpoints} must be at least 0 (0: keep all)")
    if args.checkpoint_every < 0:
        raise ConfigError(f"--checkpoint-every: {args.checkpoint_every} must be at least 0 (0: only at the end)")
    if args.checkpoint_every > args.steps:
        raise ConfigError(f"--checkpoint-every: {args.checkpoint_every} is more than --steps {args.steps}, so no "
                          "checkpoint would be written; give at most that, or 0 to save after the last step")
    if args.data != "synthetic":  # files (a blend's: runtime.blend) long enough for one sequence, in the dtype given
        from runtime.data import make_source
        make_source(args.data, t.seq_len, t.seed, plan.model.vocab, getattr(args, "data_dtype", None))
    from runtime.evaluate import check_eval_args
    check_eval_args(args, plan)
    from runtime.data import source_meta
    from runtime.documents import end_of_text
    end_of_text(plan, args, source_meta(getattr(args, "data", "synthetic")))
    return plan


def check_checkpoint_dir(args, plan) -> None:
    """What runtime.checkpoint.resume refuses inside the ranks, checked before `trident run` starts
    them (one line, not the ranks' error and the launcher's): a directory holding a checkpoint
    without --resume; with it, a checkpoint that is corrupt, of another run, or at --steps already."""
    from runtime.checkpoint import to_resume
    allowed = changeable_fields(args.allow_change) if isinstance(args.allow_change, str) else args.allow_change
    to_resume(args, plan, allowed or ())


def check_token_ids(args, plan) -> None:
    """What the ranks find only at the batch that reads it (runtime.data.TokenFileData.rows): a
    token id of --data or --eval-data (each file of a blend) at or above model.vocab, checked over
    the whole files before `trident run` starts them."""
    from runtime.data import make_source
    t = plan.training
    for flag, spec in (("--data", args.data), ("--eval-data", getattr(args, "eval_data", None))):
        if spec and spec != "synthetic":
            try:
                make_source(spec, t.seq_len, t.seed, plan.model.vocab, getattr(args, "data_dtype", None)).check_ids()
            except ConfigError as exc:  # the token-file checks name --data (runtime.evaluate.check_eval_args)
                raise ConfigError(str(exc).replace("--data:", f"{flag}:", 1)) from None


def check_out(out, n_plans: int) -> None:
    """--out names the run record's file (one plan) or a directory of them (several): refuse,
    before training, a path that cannot be that."""
    if not out:
        return
    path = Path(out)
    if n_plans > 1 and path.exists() and not path.is_dir():
        raise ConfigError(f"--out: {out} is a file; with {n_plans} plans --out names a directory to write "
                          "one record per plan into; give a directory")
    if n_plans == 1 and path.is_dir():
        raise ConfigError(f"--out: {out} is a directory; with one plan --out names the record's file, "
                          f"e.g. {path / 'run.json'}")
    if n_plans > 1:
        check_dir("--out", path)
    else:
        check_out_file("--out", out, "run.json")


def check_out_file(flag: str, out, example: str) -> None:
    """A file the command writes at its end: refuse, before the work, a directory or a device in its
    place (/dev/full filled at the end) or a place no file can be created in."""
    path = Path(out)
    if path.is_dir():
        raise ConfigError(f"{flag}: {out} is a directory; give the file's path, e.g. {path / example}")
    if path.exists() and not path.is_file():
        raise ConfigError(f"{flag}: {out} is not a regular file; give a path for the file, e.g. {example}")
    check_dir(flag, path.parent)


def check_dir(flag: str, where) -> None:
    """A directory the run creates or writes into: refuse, before training, a file in its place or
    a place it cannot write (the nearest existing directory above it must be writable)."""
    if not where:
        return
    path = Path(where)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{flag}: {where} is a file; give a directory")
    parent = path
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not _can_create_in(parent):
        raise ConfigError(f"{flag}: cannot write under {parent}; give a path in a writable directory")


def _can_create_in(directory: Path) -> bool:
    """Whether a file can be created in `directory`, by creating one: os.access says yes to root
    everywhere, and /proc or a read-only mount refuse the creation itself (found by trying
    --out /proc/x.json: a traceback after the whole run)."""
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".trident-probe-"):
            return True
    except OSError:
        return False
