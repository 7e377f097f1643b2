"""Bytes the memory-bound (pointwise, normalization, softmax) operations of one layer move.

Three implementations, chosen by the plan's `training.elementwise_kernels`:

- `eager`: the operations trident's runtime runs on GPUs (runtime/model.py, PyTorch eager), one
  kernel per operation, each reading its inputs and writing its output. Norms are one kernel
  each (GPT: native LayerNorm; Llama: F.rms_norm, on CUDA the fused aten::_fused_rms_norm,
  PyTorch PR #153666; on CPU it decomposes into float32 pow, mean, rsqrt and products, which
  this does not price). Rotary embeddings run in float32: a cast, one complex multiply, a cast
  back (20 bytes per bf16 element where a fused kernel moves 4); SwiGLU as silu and a product;
  GPT's GELU as one kernel. Backward counts what autograd runs for each operation, plus the
  sums of gradients where a tensor feeds several operations (the norm output feeds wq, wk and
  wv; in Llama blocks the second norm's output feeds w1 and w3; each residual stream feeds its
  branch and the add) and, for GPT blocks, the bias gradients (one sum over the tokens of each
  biased output). tests/test_pointwise.py traces the runtime's own block, head and loss with a
  dispatch-mode byte counter and checks these counts against it.
- `fused`: one kernel per fused group as Megatron-LM writes them (bias + GeLU, bias + dropout +
  residual add, scale + mask + softmax, SwiGLU, rotary embeddings, each in one pass): every tensor read and written once; the backward moves 1.5x the forward (three
  tensors to the forward's two). For predicting frameworks with fused kernels. Its cross-entropy is
  one fused kernel too (Megatron-Core's --cross-entropy-loss-fusion, NeMo's and Megatron-Bridge's
  default): it reads the logits, writes and re-reads float32 exponentials.
- `fused-fp32-loss`: the fused blocks with Megatron-LM's default cross-entropy,
  vocab_parallel_cross_entropy on the logits cast to float32 (legacy megatron/mpu/cross_entropy.py,
  megatron/core/tensor_parallel/cross_entropy.py; --cross-entropy-loss-fusion off): per logit
  forward the cast (e + 4 bytes; none in float32), the row maximum (4), the in-place subtraction
  (8), exp in place (8), the row sum (4) and the in-place division into the softmax kept for
  backward (8); backward the in-place product with the loss gradient (8) and the cast's gradient
  back to the logits' dtype (4 + e).

All counts are per layer per micro-batch on one device: tensors a TP group holds whole (the
residual stream) are divided by tp only under sequence parallelism, sharded ones (heads, FFN
columns, vocabulary) by tp.
"""
from __future__ import annotations

import math

from planner.model import ModelConfig
from planner.moe import ffn_width, routing_bytes

ELEMENTWISE_KERNELS = ("eager", "fused", "fused-fp32-loss")
BWD_ELEMENTWISE_FACTOR = 1.5  # fused: backward of a memory-bound op moves 3 tensors to the forward's 2


def fused_bytes(model: ModelConfig, index: int, b: int, s: int, tp: int, sp: bool, e: int,
                dropout: bool, attention: str, attention_dropout: bool | None = None,
                fp32_loss: bool = False) -> tuple[float, float]:
    """(forward, backward) bytes with fused kernels (module doc). `dropout`: on the hidden states;
    `attention_dropout`: on the attention probabilities (None: as `dropout`); `fp32_loss`:
    Megatron-LM's unfused float32 cross-entropy (fused-fp32-loss)."""
    kind = model.layer_kind(index)
    sbh = s * b * model.hidden
    rep = tp if sp else 1
    if kind == "embedding":
        pos = 3 * e * sbh if model.arch == "gpt" else 0  # add learned positions
        fwd = (2 * e * sbh + pos + ((2 * e + 1) * sbh if dropout else 0)) / rep
    elif kind == "head":
        norm, logits = 2 * e * sbh / rep, s * b * math.ceil(model.vocab / tp)
        if fp32_loss:  # the final norm; Megatron-LM's float32 cross-entropy, kernel by kernel (module doc)
            return norm + (_cast(e) + 32) * logits, BWD_ELEMENTWISE_FACTOR * norm + (8 + _cast(e)) * logits
        # final norm; cross-entropy reads the logits, writes and re-reads float32 exponentials
        fwd = norm + (e + 8) * logits
    else:
        res = (3 * e + 1) if dropout else 3 * e  # residual add (with bias + dropout fused)
        replicated = 2 * (2 * e * sbh) + 2 * res * sbh
        if model.arch == "gpt":
            sharded = 2 * e * s * b * model.ffn_hidden  # bias + GeLU
        else:
            # RoPE on q and k (and Qwen3's norm of each q and k head)
            sharded = (4 if model.qk_norm else 2) * e * s * b * (model.q_dim + model.kv_dim)
            sharded += 3 * e * s * b * ffn_width(model)  # silu(gate) * up (an MoE block's k rows a token)
            if model.moe is not None:  # the router's softmax and top-k; each row moved to its expert and back
                k, h = model.moe.experts_per_token, model.hidden
                sharded += tp * s * b * ((e + 4) * model.moe.experts + 4 * e * k * h + e * h)
        sharded += _softmax_bytes(model, b, s, e, dropout if attention_dropout is None else attention_dropout,
                                  attention)
        fwd = replicated / rep + sharded / tp
    return fwd, BWD_ELEMENTWISE_FACTOR * fwd


def _softmax_bytes(model: ModelConfig, b: int, s: int, e: int, dropout: bool, attention: str) -> float:
    """A materialized (unfused) attention's scale + mask + softmax (and dropout), forward."""
    if attention != "unfused":
        return 0.0
    return (4 * e + 1 if dropout else 2 * e) * model.heads * s * s * b


def _cast(e: int) -> int:
    """Bytes per element of a float32 upcast or of the cast back (none when already float32)."""
    return 0 if e == 4 else e + 4


def _norm(e: int) -> tuple[int, int]:
    """(forward, backward) bytes per element of a norm on a GPU: one kernel that reads and writes
    once (2e), a backward that reads the gradient and the input and writes one (3e); LayerNorm
    and fused RMSNorm alike (per-row statistics aside)."""
    return 2 * e, 3 * e


def eager_dropout_bytes(e: int, draws: float) -> tuple[float, float]:
    """(forward, backward) bytes per element of the runtime's hidden dropout (runtime.dropout): the
    mask drawn for the whole sequence (one byte for each of `draws` elements per element kept:
    tp under sequence parallelism times cp) and the rank's rows copied out of it, the masked fill
    (read the input and the mask, write) and the scale by 1 / (1 - p); backward the same two."""
    return draws + (2 if draws > 1 else 0) + (2 * e + 1) + 2 * e, (2 * e + 1) + 2 * e


def eager_bytes(model: ModelConfig, index: int, b: int, s: int, tp: int, sp: bool, e: int,
                dropout: bool, attention: str, autocast: bool = False, attention_dropout: bool | None = None,
                draws: float = 1.0) -> tuple[float, float]:
    """(forward, backward) bytes of the runtime's eager operations (module doc); `autocast`: float32
    weights under bf16 autocast, the runtime without data parallelism (_autocast_stream). Dropout on
    the hidden states as eager_dropout_bytes counts it (`draws`); on the attention probabilities
    inside the fused kernel (nothing here) or, unfused, in the softmax's pass."""
    kind = model.layer_kind(index)
    tokens = s * b
    h = model.hidden
    rep = tp if sp else 1
    # under autocast the embedding's output, and so its dropout, is float32
    drop_f, drop_b = eager_dropout_bytes(4 if autocast and kind == "embedding" else e, draws) if dropout else (0, 0)
    if kind == "embedding":
        fwd, _ = fused_bytes(model, index, b, s, tp, sp, e, False, attention)
        return fwd + drop_f * tokens * h / rep, BWD_ELEMENTWISE_FACTOR * fwd + drop_b * tokens * h / rep
    norm_f, norm_b = _norm(e)
    if kind == "head":
        vocab = tokens * math.ceil(model.vocab / tp)
        # runtime/loss.py: the row maximum (reads the logits), logits - maximum into float32,
        # exp in place, the row sum, the gradient written back in the logits' dtype; the
        # backward scales the gradient in place
        if autocast:  # a float32 norm, its output cast for the head and the cast's gradient back
            norm_f, norm_b = 2 * 4 + (4 + e), 3 * 4 + (e + 4)
        return (norm_f * tokens * h / rep + (3 * e + 20) * vocab,
                norm_b * tokens * h / rep + 2 * e * vocab)
    q, kv, f = model.q_dim / tp, model.kv_dim / tp, ffn_width(model) / tp  # an MoE block's k rows a token
    # per token: two norms and two residual adds on the residual stream (3e each: two reads,
    # one write; backward, the add of the branch's gradient to the stream's)
    stream_f = 2 * norm_f + 2 * 3 * e + 2 * drop_f
    stream_b = 2 * norm_b + 2 * 3 * e + 2 * drop_b
    # the attention input feeds wq, wk and wv (two gradient adds), the FFN input w1 and w3 in a
    # gated FFN (one); these run on the whole sequence, before sequence parallelism's scatter
    fan_in = (2 + (1 if model.arch == "llama" else 0)) * 3 * e * h
    if autocast:
        (stream_f, stream_b), fan_in = _autocast_stream(model, e, drop_f, drop_b), 0.0
    if model.arch == "gpt":
        ffn_f, ffn_b = 2 * e * f, 3 * e * f  # GELU
        rope_f = rope_b = 0.0
        bias = e * (q + 2 * kv + f + 2 * h / rep)  # bias gradients: a sum over each output
    else:
        ffn_f, ffn_b = (x * f for x in swiglu_bytes("eager", e))
        # rotary embeddings on q and k: cast to float32, one complex multiply (read and write 4
        # bytes per element), cast back; the backward the same three kernels
        rope_f = rope_b = (2 * _cast(e) + 8) * (q + kv)
        bias = e * (q + 2 * kv) if model.qkv_bias else 0.0
        if model.qk_norm:  # Qwen3's norm of each q and k head, before the rotary embedding
            rope_f, rope_b = rope_f + norm_f * (q + kv), rope_b + norm_b * (q + kv)
    soft = _softmax_bytes(model, b, s, e, dropout if attention_dropout is None else attention_dropout, attention) / tp
    route_f, route_b = routing_bytes(model, e) if model.moe is not None else (0.0, 0.0)  # whole on each TP rank
    fwd = tokens * (stream_f * h / rep + ffn_f + rope_f + route_f) + soft
    bwd = tokens * (stream_b * h / rep + fan_in + ffn_b + rope_b + bias + route_b) + BWD_ELEMENTWISE_FACTOR * soft
    return fwd, bwd


def swiglu_bytes(kernels: str, e: int) -> tuple[float, float]:
    """(forward, backward) bytes per element of SwiGLU's silu(w1 x) * w3 x: eager, the silu and the
    product (5 e forward, 9 e backward); fused, one pass (3 e, its backward BWD_ELEMENTWISE_FACTOR x)."""
    return (5 * e, 9 * e) if kernels == "eager" else (3 * e, 3 * e * BWD_ELEMENTWISE_FACTOR)


def _autocast_stream(model: ModelConfig, e: int, drop_f: float, drop_b: float) -> tuple[float, float]:
    """(forward, backward) bytes per residual-stream element of a block of the runtime without data
    parallelism: float32 weights under bf16 autocast (planner.precision.casts_weights), so
    the embedding's float32 output makes the residual stream float32. Forward: two float32 norms
    (read and write 4 bytes), autocast casting the norm's output afresh for each linear that reads
    it (q, k, v, and w1, w3 when gated: read 4, write e), two residual adds of the bf16 branch into
    the float32 stream (4 + e + 4). Backward: each cast's gradient back to float32 (e + 4), the
    float32 gradients of a norm's output added up (one add, 12 bytes, per linear beyond the first
    of each norm), the two residual adds' stream gradients (12) and their cast to bf16 for the
    branch (4 + e), two float32 norm backwards (12). tests/test_pointwise.py traces it."""
    casts = 3 + (2 if model.arch == "llama" else 1)
    fwd = casts * (4 + e) + 2 * (4 + e + 4) + 2 * 8 + 2 * drop_f
    bwd = casts * (e + 4) + (casts - 2) * 12 + 2 * 12 + 2 * (4 + e) + 2 * 12 + 2 * drop_b
    return fwd, bwd


def conversion_bytes(model: ModelConfig, index: int, b: int, s: int, tp: int, sp: bool, e: int,
                     autocast: bool = False) -> tuple[tuple[float, float], tuple[float, float]]:
    """((upcast, broadcast) forward, (upcast, broadcast) backward): the part of eager_bytes moved by
    kernels that convert dtypes (planner.device, conversion_bandwidth_bytes_per_s), none in float32.
    Upcasts: the rotary embedding's cast of q and k to float32 and, backward, its gradient's; with
    autocast the float32 residual adds of each bf16 branch (4 + e + 4 per element) and, backward,
    each norm output's cast gradients back to float32. Broadcast: runtime/loss.py's logits less
    their row maximum into float32 and its exponentials times the reciprocal row sums written back
    in the logits' dtype (e + 4 each), and backward the gradient scaled in place by a float32
    scalar (2e)."""
    if e == 4:
        return (0.0, 0.0), (0.0, 0.0)
    kind, tokens, h = model.layer_kind(index), s * b, model.hidden
    rep = tp if sp else 1
    if kind == "head":
        vocab = tokens * math.ceil(model.vocab / tp)
        up_b = (e + 4) * tokens * h / rep if autocast else 0.0
        return (0.0, 2 * (e + 4) * vocab), (up_b, 2 * e * vocab)
    if kind != "block":
        return (0.0, 0.0), (0.0, 0.0)
    rope = (e + 4) * tokens * (model.q_dim + model.kv_dim) / tp if model.arch == "llama" else 0.0
    up_f, up_b = rope, rope
    if autocast:  # as _autocast_stream counts them
        casts = 3 + (2 if model.arch == "llama" else 1)
        up_f += 2 * (4 + e + 4) * tokens * h / rep
        up_b += casts * (e + 4) * tokens * h / rep
    return (up_f, 0.0), (up_b, 0.0)


def pointwise_bytes(kernels: str, *args, autocast: bool = False, attention_dropout: bool | None = None,
                    draws: float = 1.0) -> tuple[float, float]:
    """(forward, backward) bytes of one layer's memory-bound operations with `kernels`."""
    if kernels == "eager":
        return eager_bytes(*args, autocast=autocast, attention_dropout=attention_dropout, draws=draws)
    return fused_bytes(*args, attention_dropout=attention_dropout, fp32_loss=kernels == "fused-fp32-loss")


def pointwise_seconds(device, kernels: str, model: ModelConfig, index: int, b: int, s: int, tp: int, sp: bool,
                      e: int, dropout: bool, attention: str, autocast: bool = False,
                      attention_dropout: bool | None = None, draws: float = 1.0) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's memory-bound operations on `device`: eager
    kernels that convert dtypes at their measured bandwidth (conversion_bytes)."""
    total = pointwise_bytes(kernels, model, index, b, s, tp, sp, e, dropout, attention, autocast=autocast,
                            attention_dropout=attention_dropout, draws=draws)
    conv = (conversion_bytes(model, index, b, s, tp, sp, e, autocast) if kernels == "eager"
            else ((0.0, 0.0), (0.0, 0.0)))
    return tuple(device.pointwise_seconds(t, *c) for t, c in zip(total, conv))
