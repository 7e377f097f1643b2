"""`trident run plan.json`: start torchrun with as many processes as the plan's world size.

On one node it runs `python -m runtime.torchrun --nproc-per-node N --master-port <free>
-m runtime.train --plan plan.json ...` here (runtime.torchrun is torchrun ending in one line
instead of a traceback on failure; OMP_NUM_THREADS=1 per process unless set) and returns its exit
status. A multi-node plan cannot be started from one machine: it prints the
torchrun command for every node (--nnodes, --node-rank, --rdzv-endpoint) and returns 0.
"""
from __future__ import annotations

import argparse
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

from planner.model import ConfigError
from planner.args import OneLineParser
from planner.plan import Plan
from runtime.evaluate import add_eval_args
from runtime.loss_scale import initial_scale
from runtime.run_checks import changeable_fields

REPO_ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = OneLineParser(prog="trident run", description="Train a plan with torchrun on this machine.")
    ap.add_argument("plan")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default=None, help="run.json to write")
    ap.add_argument("--force", action="store_true", help="run even if the prediction says the plan does not fit")
    ap.add_argument("--data", default="synthetic", help="synthetic, a token file, or a blend FILE:WEIGHT,FILE:WEIGHT")
    ap.add_argument("--data-dtype", choices=("uint16", "uint32"), default=None)
    ap.add_argument("--eos-id", type=int, default=None,
                    help="the end-of-text id a plan's document mask splits rows by (default: the token file's)")
    ap.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None)
    ap.add_argument("--initial-loss-scale", type=initial_scale, default=None,
                    help="fp16: the loss scale to start from (runtime.loss_scale)")
    ap.add_argument("--checkpoint-dir", default=None)
    ap.add_argument("--checkpoint-every", type=int, default=0)
    ap.add_argument("--keep-checkpoints", type=int, default=0, metavar="K",
                    help="keep the newest K checkpoints (default 0: all)")
    ap.add_argument("--metrics", default=None, metavar="FILE", help="a JSON line per step, appended as the run goes")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--async-checkpoint", action="store_true", help="write checkpoints while training goes on")
    ap.add_argument("--allow-change", default=None, metavar="FIELDS", type=lambda text: changeable_fields(text) and text,
                    help="training settings a resumed plan may change (runtime.train --allow-change)")
    ap.add_argument("--trace", default=None, metavar="DIR", help="profile the last step (runtime.trace) into DIR")
    ap.add_argument("--init-from", default=None, metavar="DIR",
                    help="start from the weights of a transformers model directory (runtime.hf_weights)")
    add_eval_args(ap)
    ap.add_argument("--rdzv-endpoint", default="NODE0_HOST:29500",
                    help="host:port of node 0, for the commands printed for a multi-node plan")
    return ap.parse_args(argv)


def train_args(args: argparse.Namespace) -> list[str]:
    """The runtime.train arguments that `trident run` passes through."""
    out = ["--plan", args.plan, "--steps", str(args.steps), "--data", args.data]
    for flag, value in (("--out", args.out), ("--data-dtype", args.data_dtype), ("--dtype", args.dtype),
                        ("--initial-loss-scale", None if args.initial_loss_scale is None else repr(args.initial_loss_scale)),
                        ("--checkpoint-dir", args.checkpoint_dir), ("--trace", args.trace),
                        ("--eval-data", args.eval_data), ("--allow-change", args.allow_change),
                        ("--init-from", args.init_from), ("--metrics", args.metrics),
                        ("--eos-id", None if args.eos_id is None else str(args.eos_id))):
        if value is not None:
            out += [flag, value]
    if args.checkpoint_every:
        out += ["--checkpoint-every", str(args.checkpoint_every)]
    if args.keep_checkpoints:
        out += ["--keep-checkpoints", str(args.keep_checkpoints)]
    if args.eval_every:
        out += ["--eval-every", str(args.eval_every), "--eval-batches", str(args.eval_batches)]
    out += ["--resume"] * args.resume + ["--force"] * args.force + ["--async-checkpoint"] * args.async_checkpoint
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_local(nproc: int, target: list[str]) -> int:
    """torchrun of `nproc` processes on this machine, through runtime.torchrun so that a failure
    ends in one line, running `target` (["-m", MODULE, ...] or [SCRIPT, ...]) on a free port, with
    this checkout importable and OMP_NUM_THREADS=1 per process unless set. Its exit status."""
    cmd = [sys.executable, "-m", "runtime.torchrun", "--nproc-per-node", str(nproc), "--master-port",
           str(free_port()), *target]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(cmd, env=env).returncode


def node_commands(plan: Plan, args: argparse.Namespace) -> list[str]:
    """One torchrun command line per node of a multi-node plan."""
    c = plan.cluster
    return [shlex.join(["torchrun", "--nnodes", str(c.nodes), "--nproc-per-node", str(c.devices_per_node),
                        "--node-rank", str(r), "--rdzv-backend", "c10d", "--rdzv-endpoint", args.rdzv_endpoint,
                        "-m", "runtime.train", *train_args(args)])
            for r in range(c.nodes)]


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        plan = Plan.read(args.plan)
        from runtime.train import check_out, check_plan  # every check that needs no process group, before launching
        from runtime.run_checks import check_checkpoint_dir, check_token_ids
        check_plan(args.plan, args, plan.mesh.world_size)
        check_checkpoint_dir(args, plan)
        check_out(args.out, 1)
        if args.init_from:
            from runtime.hf_weights import ModelDir
            ModelDir(args.init_from).check(plan.model, plan.training.seq_len)
        check_token_ids(args, plan)  # last: it reads the token files through
    except ConfigError as exc:
        print(f"trident: error: {exc}", file=sys.stderr)
        return 2
    from runtime.device import gpus_short
    short = gpus_short(plan.cluster.devices_per_node if plan.cluster.nodes > 1 else plan.mesh.world_size)
    if short and plan.cluster.nodes == 1:
        print(f"trident: error: mesh: {short}", file=sys.stderr)
        return 2
    if plan.cluster.nodes > 1:
        print(f"# {args.plan} spans {plan.cluster.nodes} nodes; run on each node (from a checkout of trident):")
        for cmd in node_commands(plan, args):
            print(cmd)
        return 0
    return run_local(plan.mesh.world_size, ["-m", "runtime.train", *train_args(args)])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
