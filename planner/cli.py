"""The `trident` command: plan, estimate, run."""
from __future__ import annotations

import argparse
import json
import sys

from planner.cluster import load_cluster
from planner.cost import estimate
from planner.model import ConfigError, load_model
from planner.plan import SCHEDULES, Plan, build_plan
from planner.report import describe_plan, estimate_table

GiB = 2**30


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v} must be at least 1")
    return v


def _cluster_for(args):
    cluster = load_cluster(args.cluster)
    if args.nodes is not None:
        return cluster.with_nodes(args.nodes)
    if args.gpus % cluster.devices_per_node and args.gpus > cluster.devices_per_node:
        raise ConfigError(f"--gpus: {args.gpus} is not a whole number of {cluster.devices_per_node}-GPU nodes; "
                          f"use a multiple of {cluster.devices_per_node} or pass --nodes")
    if args.gpus < cluster.devices_per_node:  # part of one node
        return cluster.shaped_as(1, args.gpus)
    return cluster.with_nodes(args.gpus // cluster.devices_per_node)


def _attach_prediction(plan: Plan, cluster, limit) -> tuple[Plan, object]:
    est = estimate(plan, cluster, memory_limit_bytes=limit)
    plan.prediction = _prediction_dict(est)
    return plan, est


def _prediction_dict(est) -> dict:
    d = est.to_dict()
    d.pop("stages")
    return d


def _print_estimate(plan: Plan, est, as_json: bool) -> None:
    if as_json:
        print(json.dumps(est.to_dict(), indent=2))
    else:
        print(describe_plan(plan))
        print()
        print(estimate_table(est))


def cmd_plan(args) -> int:
    model = load_model(args.model)
    cluster = _cluster_for(args)
    limit = args.memory_limit * GiB if args.memory_limit else None
    plan = build_plan(
        model, cluster_name=cluster.name, device=cluster.device.name, nodes=cluster.nodes,
        devices_per_node=cluster.devices_per_node, global_batch=args.global_batch, micro_batch=args.micro_batch,
        seq_len=args.seq_len, tp=args.tp, pp=args.pp, dp=args.dp, schedule=args.schedule,
        virtual_stages=args.virtual_stages, recompute=args.recompute, sequence_parallel=args.sequence_parallel,
        zero=args.zero, dtype=args.dtype, profile_hash=cluster.profile_hash)
    plan, est = _attach_prediction(plan, cluster, limit)
    if args.output:
        plan.write(args.output)
    _print_estimate(plan, est, args.json)
    if args.output and not args.json:
        print(f"\nwrote {args.output}")
    return 0


def cmd_estimate(args) -> int:
    plan = Plan.read(args.plan)
    cluster = load_cluster(args.cluster or plan.cluster.name).shaped_as(plan.cluster.nodes,
                                                                         plan.cluster.devices_per_node)
    if plan.cluster.profile_hash and cluster.profile_hash != plan.cluster.profile_hash and not args.json:
        print(f"note: cluster profile {cluster.name} changed since this plan was priced "
              f"({plan.cluster.profile_hash[:19]} -> {cluster.profile_hash[:19]})", file=sys.stderr)
    limit = args.memory_limit * GiB if args.memory_limit else None
    est = estimate(plan, cluster, memory_limit_bytes=limit)
    _print_estimate(plan, est, args.json)
    return 0


def cmd_run(args, rest) -> int:
    from runtime.launch import main as run_main  # imports torch only when running
    return run_main([args.plan, *rest])


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="trident", description="Plan, predict and run parallel training of large models.")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="build a hand-made plan and predict it")
    p.add_argument("--model", required=True, help="zoo name, model JSON, or Hugging Face config.json")
    p.add_argument("--cluster", required=True, help="shipped profile name or a profile JSON path")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--gpus", type=_positive_int)
    g.add_argument("--nodes", type=_positive_int)
    p.add_argument("--global-batch", type=_positive_int, required=True, help="sequences per step")
    p.add_argument("--micro-batch", type=_positive_int, required=True, help="sequences per micro-batch")
    p.add_argument("--tp", type=_positive_int, default=1)
    p.add_argument("--pp", type=_positive_int, default=1)
    p.add_argument("--dp", type=_positive_int, default=None, help="default: GPUs / (tp x pp)")
    p.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    p.add_argument("--virtual-stages", type=_positive_int, default=1, help="model chunks per pipeline rank (1: none)")
    p.add_argument("--recompute", choices=("none", "selective", "full"), default="none")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0)
    p.add_argument("--seq-len", type=_positive_int, default=None, help="default: the model's seq_len")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--memory-limit", type=float, default=None, help="GiB per device (default: the device's)")
    p.add_argument("-o", "--output", help="write the plan file here")
    p.add_argument("--json", action="store_true", help="print the estimate as JSON")
    p.set_defaults(func=cmd_plan)

    e = sub.add_parser("estimate", help="predict a plan file")
    e.add_argument("plan")
    e.add_argument("--cluster", help="price with this profile instead of the plan's")
    e.add_argument("--memory-limit", type=float, default=None, help="GiB per device")
    e.add_argument("--json", action="store_true")
    e.set_defaults(func=cmd_estimate)

    r = sub.add_parser("run", help="train a plan with torchrun (options: see `trident run PLAN --help`)",
                       add_help=False)
    r.add_argument("plan")
    r.set_defaults(func=cmd_run)
    return ap


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    try:
        if args.command == "run":
            return cmd_run(args, rest)
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        return args.func(args)
    except ConfigError as exc:
        print(f"trident: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
