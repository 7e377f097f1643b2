"""The `trident` command: plan, estimate, run."""
from __future__ import annotations

import argparse
import json
import sys

from planner.cluster import load_cluster
from planner.args import MEMORY_LIMIT_GIB, OneLineParser, choice_list, int_list, nonempty, positive_int, replica_list
from planner.cost import estimate
from planner.model import ConfigError
from planner.model_files import load_model
from planner.plan import SCHEDULES, SP_SAVED_INPUTS, Plan, priced_on
from planner.build import build_plan
from planner.training_args import (add_optimizer_args, add_training_args, dropout_note, pipeline_settings,
                                   training_settings)
from planner.report import describe_plan, estimate_table
from planner.sp_modes import EITHER

GiB = 2**30



def _cluster_for(args, gpus=None, nodes=None):
    """The cluster of --cluster at the size of --gpus or --nodes (or of `gpus` or `nodes`)."""
    if gpus is None and nodes is None:
        gpus, nodes = args.gpus, args.nodes
    return sized(load_cluster(args.cluster), gpus, nodes)


def sized(cluster, gpus=None, nodes=None):
    """`cluster` with `nodes` nodes, or enough for `gpus` GPUs (part of one node below a node)."""
    if nodes is not None:
        return cluster.with_nodes(nodes)
    if gpus % cluster.devices_per_node and gpus > cluster.devices_per_node:
        raise ConfigError(f"--gpus: {gpus} is not a whole number of {cluster.devices_per_node}-GPU nodes; "
                          f"use a multiple of {cluster.devices_per_node} or pass --nodes")
    if gpus < cluster.devices_per_node:  # part of one node
        return cluster.shaped_as(1, gpus)
    return cluster.with_nodes(gpus // cluster.devices_per_node)


def _model_profile(args):
    if not getattr(args, "model_profile", None):
        return None
    from planner.model_profile import load_model_profile
    return load_model_profile(args.model_profile)


def _attach_prediction(plan: Plan, cluster, limit, model_profile=None, keep_timeline=False) -> tuple[Plan, object]:
    est = estimate(plan, cluster, memory_limit_bytes=limit, model_profile=model_profile, keep_timeline=keep_timeline)
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


def _check_plot(args) -> None:
    if args.plot:
        from planner.compare_cli import check_plot_path
        check_plot_path(args.plot)


def _plot(args, plan, est, cluster) -> None:
    if args.plot:
        from planner.report import plot_estimate
        plot_estimate(plan, est, args.plot, cluster.device)
        if not args.json:
            print(f"wrote {args.plot}")


def cmd_plan(args) -> int:
    _check_plot(args)
    model = load_model(args.model)
    cluster = _cluster_for(args)
    limit = args.memory_limit * GiB if args.memory_limit else None
    plan = build_plan(
        model, cluster_name=cluster.name, device=cluster.device.name, nodes=cluster.nodes,
        devices_per_node=cluster.devices_per_node, global_batch=args.global_batch, micro_batch=args.micro_batch,
        seq_len=args.seq_len, tp=args.tp, pp=args.pp, dp=args.dp, schedule=args.schedule,
        virtual_stages=args.virtual_stages, recompute=args.recompute, sequence_parallel=args.sequence_parallel,
        zero=args.zero, dtype=args.dtype, profile_hash=cluster.profile_hash, lockstep=args.lockstep,
        **pipeline_settings(args),
        sp_saved_inputs=args.sp_saved_inputs, dp_replicate=args.dp_replicate, cp=args.cp, ep=args.ep,
        **training_settings(args))
    for asked, ignored in ((args.sequence_parallel and args.tp == 1, "--sequence-parallel has no effect with --tp 1"),
                           (args.virtual_stages > 1 and args.pp == 1, "--virtual-stages has no effect with --pp 1"),
                           (args.tp_comm_overlap and not args.sequence_parallel,
                            "--tp-comm-overlap has no effect without --sequence-parallel"),
                           (args.defer_grad_sync and (args.zero < 2 or plan.pipeline.micro_batches == 1),
                            "--defer-grad-sync has no effect without ZeRO 2 or 3 and several micro-batches"),
                           (True, dropout_note(args))):
        if asked and ignored:
            print(f"trident: note: {ignored}", file=sys.stderr)
    plan, est = _attach_prediction(plan, cluster, limit, _model_profile(args), keep_timeline=bool(args.plot))
    if args.output:
        plan.write(args.output)
    _print_estimate(plan, est, args.json)
    if args.output and not args.json:
        print(f"\nwrote {args.output}")
    _plot(args, plan, est, cluster)
    written = f" ({args.output} is written for `trident run --force`)" if args.output else ""
    return _fits_or_say(est, "raise --zero, --tp, --pp or --cp, use --recompute, or lower --micro-batch" + written)


def _fits_or_say(est, fix: str) -> int:
    """0 when the estimate fits; else one line on stderr (after the estimate) and exit status 3."""
    if est.fits:
        return 0
    print(f"trident: error: the plan needs {est.required_bytes / GiB:.1f} GiB per device and the device has "
          f"{est.memory_limit_bytes / GiB:.1f}; {fix}", file=sys.stderr)
    return 3


def cmd_estimate(args) -> int:
    _check_plot(args)
    plan = Plan.read(args.plan)
    cluster = load_cluster(args.cluster or plan.cluster.name).shaped_as(plan.cluster.nodes,
                                                                         plan.cluster.devices_per_node)
    plan, note = priced_on(plan, cluster)
    if note and not args.json:
        print(f"note: {note}", file=sys.stderr)
    limit = args.memory_limit * GiB if args.memory_limit else None
    est = estimate(plan, cluster, memory_limit_bytes=limit, model_profile=_model_profile(args),
                   keep_timeline=bool(args.plot))
    _print_estimate(plan, est, args.json)
    _plot(args, plan, est, cluster)
    return _fits_or_say(est, "search for one that fits (`trident search`) or change its degrees, ZeRO levels "
                        "or recomputation")


def cmd_search(args) -> int:
    from planner.search_cli import cmd_search as run  # the search command lives in its own module
    return run(args)


def _add_problem_args(p, sizes: bool = False) -> None:
    """What `plan` and `search` share: the model, the cluster and its size (`sizes`: or several
    sizes, comma-separated), the global batch."""
    p.add_argument("--model", required=True, help="zoo name, model JSON, or Hugging Face config.json")
    p.add_argument("--cluster", type=nonempty, required=True, help="shipped profile name or a profile JSON path" +
                   (" (or several, comma-separated: the best plan on each, side by side)" if sizes else ""))
    g = p.add_mutually_exclusive_group(required=True)
    several = " (or several, comma-separated: the best plan of each size, side by side)" if sizes else ""
    g.add_argument("--gpus", type=int_list() if sizes else positive_int, help="GPUs in the cluster" + several)
    g.add_argument("--nodes", type=int_list() if sizes else positive_int, help="nodes in the cluster" + several)
    p.add_argument("--global-batch", type=positive_int, required=True, help="sequences per step")
    add_training_args(p)


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog="trident", description="Plan, predict and run parallel training of large models.")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="build a hand-made plan and predict it")
    _add_problem_args(p)
    p.add_argument("--micro-batch", type=positive_int, required=True, help="sequences per micro-batch")
    p.add_argument("--tp", type=positive_int, default=1)
    p.add_argument("--pp", type=positive_int, default=1)
    p.add_argument("--dp", type=positive_int, default=None, help="default: GPUs / (tp x pp x cp)")
    p.add_argument("--cp", type=positive_int, default=1,
                   help="context parallelism: each sequence split over this many ranks (1: none)")
    p.add_argument("--dp-replicate", type=positive_int, default=1,
                   help="HSDP: ZeRO shards over dp / this many ranks and all-reduces across the copies (1: none)")
    p.add_argument("--ep", type=positive_int, default=1, help="MoE: experts spread over this many dp ranks (1: none)")
    p.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    p.add_argument("--virtual-stages", type=positive_int, default=1, help="model chunks per pipeline rank (1: none)")
    p.add_argument("--recompute", choices=("none", "selective", "full"), default="none")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0)
    p.add_argument("--seq-len", type=positive_int, default=None, help="default: the model's seq_len")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--lockstep", action="store_true",
                   help="1f1b ranks advance in lock-step with blocking exchanges (DeepSpeed's pipeline engine); prediction only")
    p.add_argument("--sp-saved-inputs", choices=SP_SAVED_INPUTS, default="shard",
                   help="under --sequence-parallel the column-parallel linears keep their input's sequence shard "
                        "and all-gather it again in the backward (as Megatron-LM), or keep the gathered input "
                        "whole: no second all-gather, more memory")
    p.add_argument("--memory-limit", type=MEMORY_LIMIT_GIB, default=None, help="GiB per device (default: the device's)")
    p.add_argument("-o", "--output", type=nonempty, help="write the plan file here")
    p.add_argument("--model-profile", type=nonempty, default=None,
                   help="price layer times from a measured model profile (`trident profile model`)")
    p.add_argument("--json", action="store_true", help="print the estimate as JSON")
    p.add_argument("--plot", type=nonempty, default=None,
                   help="write a picture of the prediction (step terms, memory, timeline)")
    add_optimizer_args(p)
    p.set_defaults(func=cmd_plan)

    e = sub.add_parser("estimate", help="predict a plan file")
    e.add_argument("plan")
    e.add_argument("--cluster", type=nonempty, help="price with this profile instead of the plan's")
    e.add_argument("--memory-limit", type=MEMORY_LIMIT_GIB, default=None, help="GiB per device")
    e.add_argument("--model-profile", type=nonempty, default=None,
                   help="price layer times from a measured model profile (`trident profile model`)")
    e.add_argument("--json", action="store_true")
    e.add_argument("--plot", type=nonempty, default=None,
                   help="write a picture of the prediction (step terms, memory, timeline)")
    e.set_defaults(func=cmd_estimate)

    s = sub.add_parser("search", help="find the fastest plan that fits and write it")
    _add_problem_args(s, sizes=True)
    s.add_argument("--seq-len", type=positive_int, default=None, help="default: the model's seq_len")
    s.add_argument("--memory-limit", type=MEMORY_LIMIT_GIB, default=None, help="GiB per device (default: the device's)")
    s.add_argument("--thorough", action="store_true",
                   help="give every configuration that its bound cannot rule out the full search of its layer "
                        "splits (about 1.5x the time; by default a configuration whose quickly found split "
                        "is slower than the best plan so far is dropped)")
    s.add_argument("--top", type=positive_int, default=5, help="show the best and the next K-1 plans (default 5; with several "
                   "clusters or sizes each search keeps K, the table shows each one's best)")
    s.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    s.add_argument("--sp-saved-inputs", choices=SP_SAVED_INPUTS + (EITHER,), default="shard",
                   help="what sequence-parallel plans keep of the inputs their column-parallel linears gather: "
                        "the shard, all-gathered again in the backward, the gathered input (faster, more memory), "
                        "or either (searched in both, the faster plan kept)")
    s.add_argument("-o", "--output", type=nonempty, help="write the best plan here")
    s.add_argument("--model-profile", type=nonempty, default=None,
                   help="price layer times from a measured model profile (`trident profile model`)")
    s.add_argument("--json", action="store_true", help="print the best estimate and the alternatives as JSON")
    s.add_argument("--plot", type=nonempty, default=None, help="write a picture of the best plan's prediction")
    add_optimizer_args(s)
    c = s.add_argument_group("constraints", "search only among these values (comma-separated lists; default: all)")
    c.add_argument("--tp", type=int_list(), default=None, help="tensor-parallel degrees, e.g. 1,2,4")
    c.add_argument("--pp", type=int_list(), default=None, help="pipeline-parallel degrees")
    c.add_argument("--dp", type=int_list(), default=None, help="data-parallel degrees")
    c.add_argument("--cp", type=int_list(), default=None,
                   help="context-parallel degrees (default: 1 and those leaving a rank at least 8192 tokens)")
    c.add_argument("--dp-replicate", type=replica_list, default=None,
                   help="HSDP replica counts searched with the rest, or 'all' (planner/hsdp.py; 1: flat data "
                        "parallelism; default: the flat plans found are split)")
    c.add_argument("--ep", type=int_list(), default=None,
                   help="expert-parallel degrees searched for an MoE model (1: none; default: all)")
    c.add_argument("--micro-batch", type=int_list(), default=None, help="sequences per micro-batch")
    c.add_argument("--schedule", type=choice_list(SCHEDULES), default=None,
                   help=f"pipeline schedules among {', '.join(SCHEDULES)}")
    c.add_argument("--virtual-stages", type=int_list(low=2), default=None,
                   help="model chunks per rank that interleaved-1f1b may use (default 2,3,4,6,8)")
    c.add_argument("--zero", type=int_list(low=0, high=3), default=None,
                   help="ZeRO levels a stage may use, e.g. 0,1")
    c.add_argument("--recompute", type=choice_list(("none", "selective", "full")), default=None,
                   help="recomputation modes a layer may use")
    c.add_argument("--sequence-parallel", choices=("on", "off"), default=None,
                   help="on: every TP plan uses sequence parallelism; off: none does (default: either)")
    c.add_argument("--even-stages", action="store_true",
                   help="split the layers evenly over the pipeline stages (default: balance them unevenly)")
    s.set_defaults(func=cmd_search)

    sub.add_parser("run", help="train a plan with torchrun (options: `trident run --help`)", add_help=False)
    sub.add_parser("profile", help="measure this machine (`profile cluster --nproc N -o F`) or a model "
                   "(`profile model --model M --cluster-profile F --seq-len S -o F`) under torchrun", add_help=False)
    from planner.cluster_cli import register
    register(sub)
    sub.add_parser("compare", help="predicted vs measured: `compare plan.json run.json [--json] [--plot out.png]`",
                   add_help=False)
    sub.add_parser("export", help="a checkpoint's model as a Hugging Face transformers directory "
                   "(`export CHECKPOINT -o DIR`)", add_help=False)
    sub.add_parser("tokenize", help="text into token files for `run --data` (`tokenize --tokenizer DIR "
                   "INPUT... -o train.bin [--val-out val.bin]`)", add_help=False)
    return ap


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if hasattr(sys.stdout, "reconfigure"):  # a name from a file path of undecodable bytes prints escaped
        sys.stdout.reconfigure(errors="backslashreplace")
    if argv[:1] == ["run"]:  # everything after `run` belongs to the launcher (runtime.launch)
        from runtime.launch import main as run_main  # imports torch only when running
        return run_main(argv[1:])
    if argv[:1] == ["profile"]:  # `trident profile cluster|model ...` runs runtime.profile under torchrun
        from runtime.profile import launch
        rest = ["--nproc-per-node" if a == "--nproc" else a for a in argv[1:]]
        return launch(rest)
    if argv[:1] == ["export"]:
        from runtime.export import main as export_main  # imports torch
        return export_main(argv[1:])
    if argv[:1] == ["tokenize"]:
        from runtime.tokens import main as tokenize_main  # Hugging Face's tokenizers library
        return tokenize_main(argv[1:])
    if argv[:1] == ["compare"]:
        from planner.compare_cli import main as compare_main
        return compare_main(argv[1:])
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    try:
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
