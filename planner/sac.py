"""Selective recomputation by operator (`training.selective_recompute: ops`): torchtitan's per-op
selective activation checkpointing, its default for its Llama models (train configs'
activation_checkpoint mode "selective" with selective_ac_option "op").

What it keeps (torchtitan/models/llama3/parallelize_llama.py at e7c0cae, 2025-06-13: `_save_list`
and `_custom_policy`, the same since its April 2024 docs/performance.md): torch.utils.checkpoint's
selective checkpoint contexts save the outputs of matrix products (aten.mm), of fused attention
(scaled_dot_product flash and efficient attention: the output and its log-sum-exp), of the
sequence-parallel reduce-scatters and of aten.max (an FP8 scale's amax, a few bytes), but of every
second matrix product of a block's forward (the policy counts them: the 2nd, 4th, ...), and
replay everything else in the backward: the other products, every norm, rotary embedding,
activation, product and residual add, the all-gathers and all-reduces. A Llama block issues its
products as q, k, v, o, gate (w1), up (w3), down (w2) (torchtitan's Attention and FeedForward:
`w2(silu(w1(x)) * w3(x))`): k, o and up are replayed. An FP8 linear (torchao's Float8Linear)
reaches the policy as aten.mm on its 8-bit operands, counted alike. Priced for bias-free Llama-family
dense blocks, torchtitan's (planner.plan_checks refuses the rest): a product with a bias (GPT's,
Qwen2's q, k and v) is aten.addmm, which the policy neither saves nor counts, and an MoE block's
experts are grouped products, not in the list.

So a block keeps its input (the checkpoint's), the saved products' outputs (a row-parallel
product's, o's and down's, before its reduction: the whole hidden width on every TP rank),
attention's output and float32 log-sum-exp, and under sequence parallelism the two
reduce-scatters' outputs; its backward replays the forward less the saved products and the
attention kernel, and the forward's TP communication less the reduce-scatters.
"""
from __future__ import annotations

SELECTIVE_RECOMPUTE = ("attention", "ops")  # training.selective_recompute; "attention": Korthikanti's core


def priced(model) -> bool:
    """Whether the policy is priced for the model's blocks (module doc): Llama-family, dense, no biases."""
    return model.arch == "llama" and not model.qkv_bias and model.moe is None


def block_products(model, tokens: float, tp: int) -> list[tuple[str, tuple]]:
    """A dense Llama block's linear products in the order its forward issues them, each (name,
    (count, M, N, K)) as planner.model.ModelConfig.block_gemms sizes them on one TP rank."""
    h, q, kv, f = model.hidden, model.q_dim // tp, model.kv_dim // tp, model.ffn_hidden // tp
    return [("q", (1, tokens, q, h)), ("k", (1, tokens, kv, h)), ("v", (1, tokens, kv, h)), ("o", (1, tokens, h, q)),
            ("gate", (1, tokens, f, h)), ("up", (1, tokens, f, h)), ("down", (1, tokens, h, f))]


def product_saved(n: int) -> bool:
    """Whether the policy keeps the output of a block's n-th matrix product (counted from 1), not
    every second one (runtime.recompute.per_op_contexts runs this rule)."""
    return n % 2 == 1


def replayed_products(model, tokens: float, tp: int) -> list[tuple]:
    """The products the policy replays."""
    return [g for n, (_, g) in enumerate(block_products(model, tokens, tp), 1) if not product_saved(n)]


def saved_products(model, tokens: float, tp: int) -> list[tuple]:
    return [g for n, (_, g) in enumerate(block_products(model, tokens, tp), 1) if product_saved(n)]


def kept_bytes(model, micro_batch: float, seq_len: int, tp: int, sequence_parallel: bool, e: int) -> float:
    """Bytes a block keeps from its forward to its backward on one TP rank (module doc): its input
    (whole on each rank unless sequence parallel), each saved product's output (a row-parallel
    product's before its reduction, the hidden width), attention's output and float32 log-sum-exp
    per head and token, and the sequence-parallel reduce-scatters' outputs."""
    tokens = micro_batch * seq_len
    rep = tp if sequence_parallel else 1
    out = e * tokens * model.hidden / rep
    out += sum(e * count * M * N for count, M, N, _ in saved_products(model, tokens, tp))
    out += e * tokens * model.q_dim / tp + 4.0 * tokens * model.heads / tp
    if sequence_parallel and tp > 1:
        out += 2 * e * tokens * model.hidden / tp
    return out


def replayed_flops(model, tokens: float) -> float:
    """FLOPs of one block's replayed products, the whole layer (one TP rank's times tp)."""
    return sum(2.0 * c * M * N * K for c, M, N, K in replayed_products(model, tokens, 1))
