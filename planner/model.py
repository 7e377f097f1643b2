"""Model specification: ModelConfig and its per-layer analytic costs (planner.zoo: the models by name).

Layers are numbered the way the plan file numbers them: layer 0 is the embedding, layers
1..L are the transformer blocks, layer L+1 is the final norm plus the output head.

Formulas and their sources:
- FLOPs: a matmul of an (m x k) by a (k x n) matrix costs 2mkn (Narayanan et al., "Efficient
  Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC'21, section 5.1).
  Attention scores and context each cost 2 b s^2 h; backward costs twice the forward. For a
  GPT block with ffn_hidden = 4h this gives that paper's 72 b s h^2 (1 + s/(6h)) per block.
- Activations saved for backward: Korthikanti et al., "Reducing Activation Recomputation in
  Large Transformer Models", 2022, section 4 (table 2). The per-tensor accounting below
  reproduces their closed forms for GPT (34 s b h + 5 a s^2 b per block; with TP t and no
  sequence parallelism 10 s b h + 24 s b h / t + 5 a s^2 b / t; sequence parallelism divides
  everything by t; selective recompute drops the 5 a s^2 b term) and extends the same accounting
  to Llama blocks (RMSNorm, SwiGLU, grouped-query attention, no dropout) and to fused
  (flash) attention, which keeps the log-sum-exp instead of the s^2 score matrix.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

ARCHS = ("gpt", "llama")
RECOMPUTE_MODES = ("none", "selective", "full")
# flash: the fused kernel torch's scaled_dot_product_attention runs on GPUs: FlashAttention-2, or
# cuDNN's, which it tries first on Hopper and Blackwell with a cuDNN newer than 9.15 (the recorded
# H200 run's trace: aten::_cudnn_attention_forward); a profile's curve says which it rates; flash-triton:
# the Triton FlashAttention kernel (flash_attn_triton, MosaicML's MPT attn_impl "triton"), the
# same algorithm and memory, its own speed (slightly below FlashAttention 1's, by its author's
# note); unfused: the softmax materialized (before FlashAttention)
ATTENTION_KERNELS = ("flash", "flash-triton", "unfused")
# the runtime's cross-entropy (runtime/loss.py) runs its float32 work on this many row chunks
LOSS_CHUNKS = 4
# bounds far above any real model (Llama 3 405B: 126 layers): a typo would run the planner for minutes
MAX_SIZE = {"layers": 10_000, "hidden": 1_000_000, "ffn_hidden": 10_000_000, "heads": 100_000,
            "kv_heads": 100_000, "vocab": 100_000_000, "seq_len": 100_000_000, "head_dim": 100_000}


from planner import moe as moe_parts
from planner.values import MAX_NAME, ConfigError, is_int, is_one_line, is_real  # noqa: F401 (their home was here)
from planner.rope import RopeScaling
from planner.sac import replayed_flops

GELU_APPROXIMATIONS = ("none", "tanh")


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer.

    `seq_len` is the longest sequence the model is built for (the learned position table of a
    GPT model has this many rows); a plan trains at a sequence length up to it.
    """

    name: str
    arch: str
    layers: int
    hidden: int
    ffn_hidden: int
    heads: int
    kv_heads: int
    vocab: int
    seq_len: int
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 adds a bias to the q, k, v projections of a llama block
    head_dim: int | None = None  # None: hidden // heads
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None  # omitted from the plan file where None
    # a gpt MLP's GELU: "none" exact (erf), "tanh" its tanh approximation (GPT-2's gelu_new);
    # torch's F.gelu `approximate` argument; omitted from the plan file where "none"
    gelu_approximate: str = "none"
    moe: moe_parts.MoESpec | None = None  # mixture-of-experts blocks (planner.moe); omitted from the plan file where None
    # Qwen3's RMSNorm of each query and key head (head_dim weights each, shared by the heads) before
    # the rotary embedding; omitted from the plan file where false
    qk_norm: bool = False

    def __post_init__(self):
        def need(cond, fld, msg):
            if not cond:
                raise ConfigError(f"model.{fld}: {msg}")

        need(is_one_line(self.name), "name",
             f"is {self.name!r}; it must be a non-empty printable string of one line, at most {MAX_NAME} characters")
        need(self.arch in ARCHS, "arch", f"is {self.arch!r}; use one of {', '.join(ARCHS)}")
        sizes = ("layers", "hidden", "ffn_hidden", "heads", "kv_heads", "vocab", "seq_len")
        for f in sizes + (("head_dim",) if self.head_dim is not None else ()):
            v = getattr(self, f)
            need(is_int(v) and v > 0, f, f"is {v!r}; it must be a positive integer")
            need(v <= MAX_SIZE[f], f, f"is {v}; at most {MAX_SIZE[f]}, far above any real model; check the value")
        for f in ("tie_embeddings", "qkv_bias", "qk_norm"):
            v = getattr(self, f)
            need(isinstance(v, bool), f, f"is {v!r}; it must be true or false")
        need(is_real(self.norm_eps) and 0 < self.norm_eps < 1, "norm_eps",
             f"is {self.norm_eps!r}; it must be a number between 0 and 1 (exclusive), e.g. 1e-5")
        need(is_real(self.rope_theta) and self.rope_theta > 0, "rope_theta",
             f"is {self.rope_theta!r}; it must be a positive number, e.g. 10000.0")
        need(self.heads % self.kv_heads == 0, "kv_heads",
             f"{self.kv_heads} does not divide heads={self.heads}; grouped-query attention needs heads to be a multiple of kv_heads")
        if self.head_dim is None:
            need(self.hidden % self.heads == 0, "heads",
                 f"{self.heads} does not divide hidden={self.hidden}; set head_dim or change heads")
        # rotary embeddings turn pairs of a head's dimensions (runtime.model.apply_rope)
        need(self.arch != "llama" or self.dim_per_head % 2 == 0, "head_dim" if self.head_dim is not None else "heads",
             f"a head of {self.dim_per_head} dimensions is odd: rotary embeddings rotate pairs; use an even head size")
        # the fields that hold an object (a dict in a plan file), for llama blocks alone
        for fld, kind, why in (
                ("rope_scaling", RopeScaling, "gpt models have learned positions, no rotary embeddings"),
                ("moe", moe_parts.MoESpec, "experts are SwiGLU MLPs of llama-family blocks; use arch llama")):
            v = getattr(self, fld)
            if isinstance(v, dict):
                v = kind.from_dict(v, where=f"model.{fld}")
                object.__setattr__(self, fld, v)
            if v is not None:
                need(isinstance(v, kind), fld, f"is {v!r}; expected null or an object with {kind.OBJECT}")
                v.check()
                need(self.arch == "llama", fld, why)
        need(self.gelu_approximate in GELU_APPROXIMATIONS, "gelu_approximate",
             f"is {self.gelu_approximate!r}; use one of {', '.join(GELU_APPROXIMATIONS)}")
        need(self.gelu_approximate == "none" or self.arch == "gpt", "gelu_approximate",
             "llama blocks use SwiGLU, no GELU")
        if self.arch == "gpt":
            need(self.kv_heads == self.heads, "kv_heads", "a gpt model has kv_heads == heads (no grouped-query attention)")
            need(not self.qkv_bias, "qkv_bias", "gpt blocks always have biases; qkv_bias is for llama-family models")
            need(not self.qk_norm, "qk_norm", "per-head query and key norms are for llama-family models (Qwen3)")

    # ---------------------------------------------------------------- shapes
    @property
    def dim_per_head(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden // self.heads

    @property
    def q_dim(self) -> int:
        return self.heads * self.dim_per_head

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.dim_per_head

    def tp_split_sizes(self) -> tuple:
        """(field, size) of each dimension tensor parallelism splits, which a TP degree must divide."""
        fs = self.moe.shared_ffn_hidden if self.moe is not None else 0
        return (("heads", self.heads), ("kv_heads", self.kv_heads), ("ffn_hidden", self.ffn_hidden)) + (
            (("moe.shared_ffn_hidden", fs),) if fs else ())

    @property
    def num_layers_total(self) -> int:
        """Embedding + blocks + head: the layer count a pipeline partition covers."""
        return self.layers + 2

    def layer_kind(self, index: int) -> str:
        if index == 0:
            return "embedding"
        if index == self.layers + 1:
            return "head"
        if 1 <= index <= self.layers:
            return "block"
        raise IndexError(f"layer {index} out of range 0..{self.layers + 1}")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        # fields added since plans and checkpoints were first written: left out at their defaults,
        # so that those read (and hash) the same
        for field, default in (("rope_scaling", None), ("gelu_approximate", "none"), ("moe", None),
                               ("qk_norm", False)):
            if d[field] == default:
                del d[field]
        return d

    @classmethod
    def from_dict(cls, d: dict, where: str = "model") -> "ModelConfig":
        if not isinstance(d, dict):
            raise ConfigError(f"{where}: expected an object with the ModelConfig fields")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"{where}.{unknown[0]}: unknown field; known fields are {', '.join(sorted(known))}")
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.default is dataclasses.MISSING and f.name not in d]
        if missing:
            raise ConfigError(f"{where}.{missing[0]}: missing; a model needs {', '.join(missing)}")
        return cls(**d)

    # ---------------------------------------------------------------- parameters
    def block_params(self) -> int:
        h, f = self.hidden, self.ffn_hidden
        if self.arch == "gpt":
            attn = h * 3 * h + 3 * h + h * h + h
            mlp = h * f + f + f * h + h
            norms = 2 * 2 * h
        else:
            attn = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h
            if self.qkv_bias:
                attn += self.q_dim + 2 * self.kv_dim
            mlp = moe_parts.ffn_params(self)[0] if self.moe is not None else 3 * h * f
            norms = 2 * h + (2 * self.dim_per_head if self.qk_norm else 0)
        return attn + mlp + norms

    def embedding_params(self) -> int:
        pos = self.seq_len * self.hidden if self.arch == "gpt" else 0
        return self.vocab * self.hidden + pos

    def head_params(self, held: bool = True) -> int:
        """Final norm + output projection. With tied embeddings the projection is the embedding
        matrix: `held=True` counts it anyway (a pipeline stage holding the head keeps a copy)."""
        norm = 2 * self.hidden if self.arch == "gpt" else self.hidden
        proj = self.vocab * self.hidden if (held or not self.tie_embeddings) else 0
        return norm + proj

    def layer_params(self, index: int, held: bool = True) -> int:
        kind = self.layer_kind(index)
        if kind == "embedding":
            return self.embedding_params()
        if kind == "head":
            return self.head_params(held=held)
        return self.block_params()

    def num_parameters(self) -> int:
        """Unique trainable parameters (a tied head counted once)."""
        return self.embedding_params() + self.layers * self.block_params() + self.head_params(held=False)

    def active_parameters(self) -> int:
        """Parameters a token's computation uses: all of a dense model's; of an MoE model's experts,
        experts_per_token a block (what its FLOPs count, Jiang et al. 2024's "active parameters")."""
        idle = (self.moe.experts - self.moe.experts_per_token) * 3 * self.hidden * self.ffn_hidden if self.moe else 0
        return self.num_parameters() - self.layers * idle

    def block_matmul_params(self) -> int:
        h, f = self.hidden, self.ffn_hidden
        if self.arch == "gpt":
            return 4 * h * h + 2 * h * f
        return 2 * h * self.q_dim + 2 * h * self.kv_dim + (moe_parts.ffn_active_params(self) if self.moe else 3 * h * f)

    # ---------------------------------------------------------------- FLOPs
    def attention_core_flops(self, micro_batch: int, seq_len: int) -> float:
        """Scores (Q K^T) and context (A V) of one block, forward: 4 b s^2 (heads * head_dim)."""
        return 4.0 * micro_batch * seq_len * seq_len * self.q_dim

    def layer_forward_flops(self, index: int, micro_batch: int, seq_len: int) -> float:
        """Forward FLOPs of one layer for one micro-batch (whole layer, before any TP split)."""
        kind = self.layer_kind(index)
        tokens = micro_batch * seq_len
        if kind == "embedding":
            return 0.0
        if kind == "head":
            return 2.0 * tokens * self.hidden * self.vocab
        return 2.0 * tokens * self.block_matmul_params() + self.attention_core_flops(micro_batch, seq_len)

    def model_flops_per_step(self, global_batch: int, seq_len: int, recompute: str = "none") -> float:
        """Model FLOPs of one training step, counted the Megatron way (SC'21 eq. 3): forward +
        backward (2x forward), plus one more forward of every block when recompute is full."""
        fwd_blocks = self.layers * self.layer_forward_flops(1, global_batch, seq_len)
        fwd_head = self.layer_forward_flops(self.layers + 1, global_batch, seq_len)
        passes = 4.0 if recompute == "full" else 3.0
        return passes * fwd_blocks + 3.0 * fwd_head

    def executed_flops_per_step(self, global_batch: int, seq_len: int, recompute_of_blocks: list,
                                selective: str = "attention") -> float:
        """FLOPs a step executes, recomputation included (what hardware FLOPs utilization counts,
        Korthikanti et al. 2022, section 6.1): the model FLOPs, plus one more forward of each block
        recomputed in full, or under selective recomputation of its attention core (`selective`
        "ops": of its replayed products, planner.sac)."""
        block = self.layer_forward_flops(1, global_batch, seq_len)
        core = (replayed_flops(self, global_batch * seq_len) if selective == "ops"
                else self.attention_core_flops(global_batch, seq_len))
        extra = sum(block if r == "full" else core if r == "selective" else 0.0 for r in recompute_of_blocks)
        return self.model_flops_per_step(global_batch, seq_len) + extra

    def block_gemms(self, micro_batch: int, seq_len: int, tp: int = 1) -> list[tuple[int, int, int, int]]:
        """The forward matrix multiplications of one block on one TP rank, as (count, M, N, K):
        each costs 2 M N K FLOPs and reads M K + K N, writes M N elements. Attention scores and
        context are batched over micro_batch * heads / tp (the unfused form; see cost.py for fused)."""
        t, tokens, h, d = tp, micro_batch * seq_len, self.hidden, self.dim_per_head
        heads = micro_batch * (self.heads // t)
        qkv = (self.q_dim + 2 * self.kv_dim) // t
        out = [(1, tokens, qkv, h), (1, tokens, h, self.q_dim // t)]
        if self.arch == "gpt":
            out += [(1, tokens, self.ffn_hidden // t, h), (1, tokens, h, self.ffn_hidden // t)]
        elif self.moe is not None:
            out += moe_parts.ffn_gemms(self, tokens, t)
        else:
            out += [(2, tokens, self.ffn_hidden // t, h), (1, tokens, h, self.ffn_hidden // t)]
        out += [(heads, seq_len, seq_len, d), (heads, seq_len, d, seq_len)]  # Q K^T, A V
        return out

    # ---------------------------------------------------------------- activations
    def loss_bytes(self, micro_batch: int, seq_len: int, tp: int, bytes_per_element: int) -> tuple[float, float]:
        """(held, transient) bytes of the runtime's cross-entropy (runtime/loss.py) on one device:
        held from forward to backward, the logits' gradient in the logits' dtype (this rank's
        vocabulary slice); transient while the loss's forward runs, the logits themselves and
        the float32 buffer of one of LOSS_CHUNKS row chunks."""
        tokens, vocab = micro_batch * seq_len, math.ceil(self.vocab / tp)
        held = bytes_per_element * tokens * vocab
        return held, held + 4.0 * math.ceil(tokens / LOSS_CHUNKS) * vocab

    def weight_grad_inputs_per_token(self, index: int, tp: int = 1, sequence_parallel: bool = False) -> float:
        """Elements per token a layer's weight gradients start from: the gradient of the output of
        each operation with a weight (the products, the norms, the embedding), on one TP rank. A
        schedule that runs the weight gradients apart from the input gradients (zbv: torch.
        distributed.pipelining's stage_backward_input keeps them for stage_backward_weight) holds
        them in between. Column-parallel outputs are split tp ways; row-parallel ones (attention
        output, last MLP projection) are whole on every rank; a norm's output (two in a block, the
        final one in the head) is whole too, or a sequence shard under sequence parallelism.
        Measured on CPU (zbv, 4 blocks of hidden 256 a stage): 2.95 MiB a block from I to W per
        256 tokens in float32, where the products alone give 2.5 and the norms 0.5."""
        kind, h = self.layer_kind(index), self.hidden
        norm = h / (tp if sequence_parallel else 1)
        if kind == "embedding":
            return float(h)
        if kind == "head":
            return math.ceil(self.vocab / tp) + norm
        column, whole = (2 if self.arch == "llama" else 1) * self.ffn_hidden, h
        if self.moe is not None:
            column, whole = moe_parts.weight_grad_outputs(self)
        qk = self.q_dim + self.kv_dim if self.qk_norm else 0  # the q and k norms' outputs
        return (self.q_dim + 2 * self.kv_dim + column + qk) / tp + h + whole + 2 * norm

    def activation_bytes(self, index: int, micro_batch: int, seq_len: int, tp: int = 1,
                         sequence_parallel: bool = False, recompute: str = "none",
                         bytes_per_element: int = 2, dropout: bool = False,
                         attention: str = "flash", attention_dropout: bool | None = None,
                         fused_swiglu: bool = False) -> float:
        """Bytes one device keeps from the forward of one micro-batch until its backward.

        Per-tensor accounting after Korthikanti et al. 2022 (see module docstring). Tensors a TP
        group holds whole (norm inputs, the inputs of the first projections, dropout masks on the
        residual stream) are divided by `tp` only under sequence parallelism; dropout masks are one
        byte per element; fused attention keeps a float32 log-sum-exp per head and token.
        `dropout`: on the hidden states; `attention_dropout`: on the attention probabilities (None: as
        `dropout`), whose mask only an unfused attention keeps. `fused_swiglu`: SwiGLU as one
        kernel (Megatron-Core's SwiGLUFunction in megatron/core/fusions/fused_bias_swiglu.py, on
        unless --no-bias-swiglu-fusion; TransformerEngine's), which saves its input alone (the
        gate and up outputs, 2 ffn_hidden) where eager SwiGLU also keeps silu(gate) for the
        product's backward: 3 ffn_hidden with the second projection's input, not 4 (dense blocks;
        experts are counted at 4, the upper bound).
        """
        if recompute not in RECOMPUTE_MODES:
            raise ConfigError(f"recompute: {recompute!r}; use one of {', '.join(RECOMPUTE_MODES)}")
        if attention not in ATTENTION_KERNELS:
            raise ConfigError(f"attention: {attention!r}; use one of {', '.join(ATTENTION_KERNELS)}")
        b, s, h, t, e = micro_batch, seq_len, self.hidden, tp, bytes_per_element
        sbh = s * b * h
        rep = t if sequence_parallel else 1  # divisor for tensors held whole by each TP rank
        kind = self.layer_kind(index)
        if kind == "embedding":
            mask = sbh / rep if dropout else 0.0  # embedding dropout mask
            return 8.0 * b * s + mask  # int64 token ids (and positions) for the gather's backward
        if kind == "head":
            # final norm input and head input (whole per rank unless SP), and the loss's logits
            # gradient, computed in the forward (loss_bytes)
            return 2 * e * sbh / rep + self.loss_bytes(micro_batch, seq_len, tp, e)[0]
        if recompute == "full":
            return e * sbh / rep  # only the block input is kept (Korthikanti: 2 s b h per layer)
        f, a = self.ffn_hidden, self.heads
        replicated = 4 * e * sbh + (2 * sbh if dropout else 0)  # 2 norm inputs, 2 projection inputs, 2 masks
        if self.arch == "gpt":
            sharded = e * s * b * (self.q_dim + self.kv_dim) + e * s * b * self.kv_dim  # Q, K, V
            sharded += e * s * b * self.q_dim  # attention output = input of the output projection
            sharded += 2 * e * s * b * f  # GeLU input, second linear input
        else:
            sharded = e * s * b * (self.q_dim + 2 * self.kv_dim)  # Q, K (after RoPE), V
            if self.qk_norm:  # the q and k norms' inputs and float32 1 / rms of each head
                sharded += s * b * (e * (self.q_dim + self.kv_dim) + 4 * (self.heads + self.kv_heads))
            sharded += e * s * b * self.q_dim
            kept = 3 if fused_swiglu else 4  # gate and up out, [silu(gate),] their product
            sharded += kept * e * s * b * f
            if self.moe is not None:  # k rows' SwiGLUs and the routing's (planner.moe); experts' SwiGLUs
                # counted eager (4) in every mode: no framework's expert kernels were read for this
                whole, swiglu = moe_parts.activation_parts(self, e)
                sharded += s * b * (swiglu - kept * e * f + whole * t)  # whole: not split (times t / t)
        if recompute == "none":
            if attention == "unfused":
                core = e * a * s * s * b  # softmax output
                if dropout if attention_dropout is None else attention_dropout:
                    core += a * s * s * b + e * a * s * s * b  # dropout mask and dropout output
            else:
                core = 4.0 * a * s * b  # float32 log-sum-exp
            sharded += core
        return replicated / rep + sharded / t
