"""The training settings `trident plan` and `trident search` write into a plan: dropout, document
masks, the mixture-of-experts options, how the framework runs the plan and the optimizer's, read
from the command line and checked (one line naming the option)."""
from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

from planner.args import non_negative_int, non_negative_number, number_in, probability
from planner.fp8 import FP8_RECIPES
from planner.model import ATTENTION_KERNELS, ConfigError
from planner.plan import GRAD_ACCUMULATION, LR_DECAYS, Training
from planner.pointwise import ELEMENTWISE_KERNELS
from planner.plan_checks import check_optimizer
from planner.sac import SELECTIVE_RECOMPUTE
from planner.zoo import ZOO


def add_training_args(p) -> None:
    """What the data and the model train with beyond the optimizer: dropout, document masks and the
    mixture-of-experts options."""
    p.add_argument("--dropout", type=probability, default=0.0,
                   help="dropout on the hidden states: the embedding's output, each block's attention and MLP "
                        "outputs (Megatron-LM's GPT default 0.1; priced: masks and kernels; default 0)")
    p.add_argument("--attention-dropout", type=probability, default=None,
                   help="dropout on the attention probabilities (default: --dropout)")
    p.add_argument("--document-mask", action="store_true",
                   help="attention stays inside each document of a packed sequence (an end-of-text id ends one; "
                        "priced: a dense mask, every score computed; no context parallelism)")
    p.add_argument("--eod-mask-loss", action="store_true",
                   help="no loss where the input is the end-of-text id (Megatron-LM's --eod-mask-loss)")
    p.add_argument("--reset-position-ids", action="store_true",
                   help="positions restart with each document (Megatron-LM's; needs --document-mask)")
    p.add_argument("--fp8", choices=FP8_RECIPES, default=None,
                   help="the blocks' linear layers on FP8 tensor cores, by scaling recipe: tensorwise (torchao / "
                        "torchtitan float8), current or delayed (TransformerEngine), mxfp8 (Blackwell); "
                        "prediction only (planner.fp8)")
    p.add_argument("--fp8-param-gather", action="store_true",
                   help="with --fp8: the FP8 linears' weights held and all-gathered in 8 bits (Megatron-LM's "
                        "--fp8-param-gather, torchtitan's enable_fsdp_float8_all_gather); prediction only")
    p.add_argument("--tp-comm-overlap", action="store_true",
                   help="with --sequence-parallel: TP all-gathers and reduce-scatters beside the linears' GEMMs "
                        "(Megatron-LM's --tp-comm-overlap, torchtitan's async TP); prediction only")
    p.add_argument("--moe-aux-loss", type=number_in(0, 1), default=0.0,
                   help="MoE models: the load-balancing loss's coefficient (Switch Transformer's 0.01; default 0)")
    p.add_argument("--moe-load-factor", type=number_in(1, 1e6), default=1.0,
                   help="MoE models: the busiest expert's routed rows over the mean, priced under expert "
                        "parallelism (`trident run` measures it: run.json moe_load_factor; default 1, balanced)")
    add_framework_args(p)


def add_framework_args(p) -> None:
    """How the framework that trains the plan runs it, where not as trident's runtime does: `plan`
    prices a hand-made plan and `search` searches with them (planner.plan.Training's fields)."""
    g = p.add_argument_group("framework", "how the training framework runs the plan (default: as trident's "
                                          "runtime does; the others are for prediction)")
    g.add_argument("--no-overlap-grad-reduce", action="store_true",
                   help="reduce data-parallel gradients after the whole backward (Megatron-LM v2 local DDP, DeepSpeed pipeline)")
    g.add_argument("--no-overlap-param-gather", action="store_true",
                   help="ZeRO 1/2: all-gather the updated parameters after the optimizer step, not in the next forward "
                        "(DeepSpeed's ZeRO 1, Megatron-LM's distributed optimizer without --overlap-param-gather)")
    g.add_argument("--async-tp-allreduce", action="store_true",
                   help="the backward's TP all-reduces run alongside the weight-gradient GEMMs (Megatron-LM "
                        "since 2021-09; prediction only)")
    g.add_argument("--grad-accumulation", choices=GRAD_ACCUMULATION, default="separate-fp32",
                   help="how micro-batch gradients add up: a pass over fp32 gradients (the runtime), over 16-bit "
                        "ones (Megatron-LM fp16, DeepSpeed), or inside the weight-gradient GEMM (Megatron-LM "
                        "gradient accumulation fusion); the last two for prediction only")
    g.add_argument("--attention", choices=ATTENTION_KERNELS, default="flash",
                   help="attention kernel: FlashAttention-2 (the runtime's SDPA), the Triton FlashAttention "
                        "kernel, or a materialized softmax; the last two for prediction only")
    g.add_argument("--elementwise-kernels", choices=ELEMENTWISE_KERNELS, default="eager",
                   help="memory-bound operations one PyTorch kernel each (the runtime) or fused as Megatron-LM "
                        "fuses them (a one-kernel SwiGLU keeps 3 ffn_hidden a token, not 4), with a fused "
                        "cross-entropy or (fused-fp32-loss) Megatron-LM's default float32 one (prediction only)")
    g.add_argument("--selective-recompute", choices=SELECTIVE_RECOMPUTE, default="attention",
                   help="what --recompute selective replays: the attention core (the runtime; Korthikanti et al. "
                        "2022) or, as torchtitan's per-op policy, all but attention and every other matrix "
                        "product (planner.sac)")
    g.add_argument("--no-fsdp-copies", action="store_true",
                   help="data parallelism gathers into and reduces from flat buffers, with none of FSDP2's "
                        "copies (Megatron-LM's DDP, DeepSpeed, FSDP1; prediction only)")
    g.add_argument("--defer-grad-sync", action="store_true",
                   help="ZeRO 2/3 reduce-scatter once, in the last micro-batch's backward, the others accumulating "
                        "unsharded gradients (FSDP2's set_requires_gradient_sync(False), FSDP1's no_sync)")
    g.add_argument("--recv-buffers", choices=("preallocated", "in-flight"), default="in-flight",
                   help="pipeline receive buffers: only those in flight (the runtime, Megatron-LM, DeepSpeed) or "
                        "one per micro-batch held all step (torch.distributed.pipelining's own)")
    g.add_argument("--sent-outputs", choices=("kept", "freed"), default="kept",
                   help="a stage's output once sent: kept to its backward (the runtime) or freed "
                        "(Megatron-LM's deallocate_output_tensor; prediction only)")
    g.add_argument("--p2p", choices=("full", "scatter-gather"), default="full",
                   help="pipeline transfers: whole tensors from every TP rank (the runtime) or 1/tp each and an "
                        "all-gather on arrival (Megatron-LM, DeepSpeed; prediction only)")


def pipeline_settings(args) -> dict:
    """The framework's pipeline settings (add_framework_args), as build_plan and search take them."""
    return dict(recv_buffers=args.recv_buffers, sent_outputs=args.sent_outputs, p2p=args.p2p)


def add_optimizer_args(p) -> None:
    """The optimizer settings `plan` and `search` write into the plan's training (the runtime's AdamW)."""
    g = p.add_argument_group("optimizer", "written into the plan for `trident run`; no effect on the prediction")
    d = Training(global_batch=1, micro_batch=1, seq_len=1)
    g.add_argument("--lr", type=non_negative_number, default=d.lr, help=f"peak learning rate (default {d.lr:g})")
    g.add_argument("--weight-decay", type=non_negative_number, default=d.weight_decay,
                   help=f"AdamW's (default {d.weight_decay:g})")
    g.add_argument("--grad-clip", type=non_negative_number, default=d.grad_clip,
                   help=f"clip the gradient norm over the whole model to this (default {d.grad_clip:g})")
    g.add_argument("--lr-warmup-steps", type=non_negative_int, default=0, help="linear warm-up over the first steps")
    g.add_argument("--lr-decay", choices=LR_DECAYS, default="constant",
                   help="after the warm-up, from --lr down to --min-lr at step --lr-decay-steps")
    g.add_argument("--lr-decay-steps", type=non_negative_int, default=0,
                   help="the step the decay reaches --min-lr, counted from the first (warm-up included)")
    g.add_argument("--min-lr", type=non_negative_number, default=0.0, help="the learning rate after the decay")


def dropout_note(args) -> str | None:
    """A note where --model is a Hugging Face config that trains with dropout and none was asked for
    (printed once the command's plan is made: an error before it stays the only line)."""
    if args.dropout or args.attention_dropout is not None or args.model in ZOO or not Path(args.model).is_file():
        return None
    try:
        cfg = json.loads(Path(args.model).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict) or "model_type" not in cfg:
        return None
    from planner.hf_config import config_dropouts
    hidden, attention = config_dropouts(cfg)
    if not hidden and not attention:
        return None
    return (f"{args.model} trains with dropout (hidden {hidden:g}, attention {attention:g}); the plan has none: "
            f"pass --dropout {hidden:g} --attention-dropout {attention:g} to plan and run with it")


def training_settings(args) -> dict:
    """The Training fields of add_optimizer_args and add_training_args, checked (one line naming the option)."""
    kw = dict(lr=args.lr, weight_decay=args.weight_decay, grad_clip=args.grad_clip, lr_warmup_steps=args.lr_warmup_steps,
              lr_decay=args.lr_decay, lr_decay_steps=args.lr_decay_steps, min_lr=args.min_lr)
    try:
        check_optimizer(SimpleNamespace(**kw))
    except ConfigError as exc:
        raise ConfigError(re.sub(r"training\.(\w+)", lambda m: "--" + m.group(1).replace("_", "-"), str(exc))) from None
    kw.update(overlap_grad_reduce=not args.no_overlap_grad_reduce, overlap_param_gather=not args.no_overlap_param_gather,
              fsdp_copies=not args.no_fsdp_copies)
    return dict(kw, **{k: getattr(args, k) for k in ("async_tp_allreduce", "grad_accumulation", "attention",
                                                      "elementwise_kernels", "selective_recompute",
                                                      "dropout", "attention_dropout", "document_mask", "eod_mask_loss",
                                                      "reset_position_ids", "moe_aux_loss",
                                                      "moe_load_factor", "fp8", "fp8_param_gather",
                                                      "tp_comm_overlap", "defer_grad_sync")})
