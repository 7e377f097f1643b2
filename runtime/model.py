"""The transformer the runtime trains: one implementation for the gpt and llama families.

Layers are numbered as in the plan: module "0" of `layers` is the embedding, "1".."L" are the
blocks, "L+1" is the final norm plus the output head. A pipeline stage deletes the layers it does
not own; `forward` then runs any contiguous range (token ids in if it owns the embedding, hidden
states otherwise; logits out if it owns the head).

Attention reads its head count from the local width of the q/k/v projections, so the same code
runs whole or tensor-parallel (heads / tp and kv_heads / tp per rank).
"""
from __future__ import annotations

import math
import zlib
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from planner.model import ModelConfig
from runtime.documents import masked_attention
from runtime.dropout import ATTENTION_OUT, EMBEDDING, MLP_OUT
from runtime.moe import MoEFeedForward
from runtime.recompute import per_op_contexts, replay_once


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # one fused kernel on CUDA (aten::_fused_rms_norm, float32 inside), which needs the weight
        # in the input's dtype (Qwen3's q and k norms read bf16 projections under autocast, their
        # weights float32: cast, head_dim elements); decomposed on CPU
        w = self.weight if self.weight.dtype == x.dtype else self.weight.to(x.dtype)
        return F.rms_norm(x, w.shape, w, self.eps)


def rope_tables(cfg: ModelConfig, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [seq_len, head_dim / 2] of rotary position embeddings (Su et al. 2021)."""
    d = cfg.dim_per_head
    inv_freq = scaled(1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d)),
                      cfg.rope_scaling)
    angles = torch.outer(torch.arange(cfg.seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def scaled(inv_freq: torch.Tensor, scaling) -> torch.Tensor:
    """Frequencies under planner.model.RopeScaling (None: as they are)."""
    if scaling is None:
        return inv_freq
    if scaling.type == "linear":
        return inv_freq / scaling.factor
    old = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    # 0 at wavelengths of old / low_freq_factor and beyond (divided by factor), 1 at old /
    # high_freq_factor and below (kept), linear in old / wavelength between
    keep = ((old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)).clamp(0, 1)
    return (1 - keep) * inv_freq / scaling.factor + keep * inv_freq


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of x [b, s, heads, d] by the position angle: each pair as one
    complex number times e^(i angle), in float32. One multiply kernel over x where the rotation
    written out in reals (four products, a sum, a difference, a stack) takes seven, each a pass over
    memory (planner.pointwise prices the kernels the runtime runs)."""
    s = x.shape[1]
    if cos.dim() == 3:  # a row's own positions (runtime.documents: reset per document), [b, s, d / 2]
        turn = torch.complex(cos.float(), sin.float()).unsqueeze(2)
    else:
        turn = torch.complex(cos[:s].float(), sin[:s].float()).view(1, s, 1, -1)
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * turn).flatten(-2).type_as(x)


def _sdpa(q, k, v, dropout_p: float = 0.0):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p,
                                          enable_gqa=q.shape[1] != k.shape[1])


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        bias_qkv = cfg.arch == "gpt" or cfg.qkv_bias
        self.head_dim = cfg.dim_per_head
        self.rope = cfg.arch == "llama"
        self.wq = nn.Linear(cfg.hidden, cfg.q_dim, bias=bias_qkv)
        self.wk = nn.Linear(cfg.hidden, cfg.kv_dim, bias=bias_qkv)
        self.wv = nn.Linear(cfg.hidden, cfg.kv_dim, bias=bias_qkv)
        self.wo = nn.Linear(cfg.q_dim, cfg.hidden, bias=cfg.arch == "gpt")
        if cfg.qk_norm:  # Qwen3: each q and k head normalized before the rotation (by name: TP shards its input)
            self.q_norm, self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps), RMSNorm(self.head_dim, cfg.norm_eps)
        self.selective_recompute = False  # checkpoint only the attention core (SDPA)
        self.context = None  # context parallelism: runtime.context_parallel.ContextParallel
        self.dropout = None  # training.dropout: runtime.dropout.Dropout
        self.key = None  # the dropout key of the forward (Block._forward sets it; a replay alike)

    def forward(self, x, cos=None, sin=None, mask=None):
        """`mask`: the micro-batch's runtime.documents.DocumentMask under a document mask, else None."""
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        core = _sdpa if self.context is None else self.context.attend  # the latter gathers K and V
        if mask is not None:
            core = partial(masked_attention, mask=mask)
        if self.key is not None:
            core = self.dropout.attention_core(core, self.key[:3], self.key[3])
        if self.selective_recompute and torch.is_grad_enabled():
            out = checkpoint(core, q, k, v, use_reentrant=False)
        else:
            out = core(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gated, self.approximate = cfg.arch == "llama", cfg.gelu_approximate
        bias = cfg.arch == "gpt"
        self.w1 = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=bias)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.hidden, bias=bias)
        if self.gated:
            self.w3 = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=False)

    def forward(self, x):
        if self.gated:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x), approximate=self.approximate))


def _norm(cfg: ModelConfig) -> nn.Module:
    if cfg.arch == "gpt":
        return nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)
    return RMSNorm(cfg.hidden, cfg.norm_eps)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = _norm(cfg)
        self.attention = Attention(cfg)
        self.ffn_norm = _norm(cfg)
        self.feed_forward = FeedForward(cfg) if cfg.moe is None else MoEFeedForward(cfg)

        self.full_recompute = False  # checkpoint the whole block: keep only its input for backward
        self.per_op = False  # torchtitan's per-op selective recomputation of the block (runtime.recompute)
        self.replay_once = False  # recompute for a split backward (runtime.recompute)
        self.dropout = None  # training.dropout: runtime.dropout.Dropout

    def _forward(self, x, cos, sin, key=None, mask=None):
        """`key`: (step, first row, rows, layer) of the micro-batch under dropout, else None;
        `mask`: its document mask (runtime.documents), else None."""
        self.attention.key = key
        h = self.attention(self.attention_norm(x), cos, sin, mask=mask)  # by name: TP prepares the others
        if key is not None:
            h = self.dropout.hidden(h, key[:3], key[3], ATTENTION_OUT)
        x = x + h
        h = self.feed_forward(self.ffn_norm(x))
        return x + (h if key is None else self.dropout.hidden(h, key[:3], key[3], MLP_OUT))

    def forward(self, x, cos=None, sin=None, key=None, mask=None):
        if self.per_op and torch.is_grad_enabled():
            return checkpoint(self._forward, x, cos, sin, key, mask, use_reentrant=False, context_fn=per_op_contexts)
        if self.full_recompute and torch.is_grad_enabled():
            if self.replay_once:
                return replay_once(self._forward, x, cos, sin, key, mask)
            return checkpoint(self._forward, x, cos, sin, key, mask, use_reentrant=False)
        return self._forward(x, cos, sin, key, mask)


class Embedding(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos_embeddings = nn.Embedding(cfg.seq_len, cfg.hidden) if cfg.arch == "gpt" else None

    def forward(self, ids, positions=None):
        h = self.tok_embeddings(ids)
        if self.pos_embeddings is not None:
            pos = torch.arange(ids.shape[1], device=ids.device) if positions is None else positions
            h = h + self.pos_embeddings(pos if pos.dim() == 2 else pos.unsqueeze(0).expand(ids.shape[0], -1))
        return h


class Head(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = _norm(cfg)
        self.output = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, h):
        return self.output(self.norm(h))


class Transformer(nn.Module):
    """Layers [start, end) of a ModelConfig (the whole model by default)."""

    def __init__(self, cfg: ModelConfig, start: int = 0, end: int | None = None):
        super().__init__()
        end = cfg.num_layers_total if end is None else end
        self.cfg = cfg
        self.layers = nn.ModuleDict()
        for i in range(start, end):
            kind = cfg.layer_kind(i)
            self.layers[str(i)] = Embedding(cfg) if kind == "embedding" else Head(cfg) if kind == "head" else Block(cfg)
        if cfg.tie_embeddings and start == 0 and end == cfg.num_layers_total:  # one parameter; a
            # pipeline's head keeps a copy instead (runtime.tied)
            self.layers[str(end - 1)].output.weight = self.layers["0"].tok_embeddings.weight
        self.positions = None  # the tokens' positions where not 0..s-1 (context parallelism)
        self.dropout = None  # training.dropout: runtime.dropout.Dropout (runtime.dropout.attach_dropout)
        self.documents = None  # training.document_mask: runtime.documents.Documents
        self.register_buffer("rope_cos", None, persistent=False)
        self.register_buffer("rope_sin", None, persistent=False)
        if cfg.arch == "llama":
            self.rope_cos, self.rope_sin = rope_tables(cfg)

    def init_buffers(self, device) -> None:
        """Compute the RoPE tables (buffers are computed, never random), rows in `positions` order."""
        if self.cfg.arch == "llama":
            self.rope_cos, self.rope_sin = rope_tables(self.cfg, device=device)
            if self.positions is not None:
                self.rope_cos, self.rope_sin = self.rope_cos[self.positions], self.rope_sin[self.positions]

    def forward(self, x):
        drop = self.dropout.key(x.shape[0]) if self.dropout is not None and torch.is_grad_enabled() else None
        mask = self.documents.mask(x.shape[0]) if self.documents is not None else None
        cos, sin, positions = self.rope_cos, self.rope_sin, self.positions
        if mask is not None and self.documents.reset_positions:  # each row's own (runtime.documents)
            positions = mask.positions()
            cos, sin = (None, None) if cos is None else (cos[positions], sin[positions])
        for name, layer in self.layers.items():
            if isinstance(layer, Block):
                x = layer(x, cos, sin, None if drop is None else (*drop, int(name)), mask)
            elif isinstance(layer, Embedding):
                x = layer(x, positions)
                if drop is not None:
                    x = self.dropout.hidden(x, drop, 0, EMBEDDING)
            else:
                x = layer(x)
        return x



def full_init(name: str, shape, seed: int, cfg: ModelConfig) -> torch.Tensor:
    """The full (unsharded) initial value of parameter `name`, from a generator seeded by
    (seed, name) alone, so every plan starts from the same model: norm weights 1, biases 0,
    other weights N(0, 0.02), residual output projections N(0, 0.02 / sqrt(2 L)) (GPT-2)."""
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    std = 0.02 / math.sqrt(2 * cfg.layers) if name.endswith(("wo.weight", "w2.weight")) else 0.02
    return torch.randn(shape, generator=gen) * std


@torch.no_grad()
def init_weights(chunk: Transformer, seed: int, full_of=None) -> None:
    """Fill a materialized (to_empty) chunk: each parameter gets its slice of the full tensor
    full_init makes, or `full_of(name, shape)` gives (trident run --init-from: runtime.hf_weights.
    HFInit, whose `local` reads a rank's block alone), whatever its DTensor placements; RoPE tables
    are computed."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    from runtime.tied import EMBEDDING, head_weight
    copy = head_weight(chunk.cfg) if chunk.cfg.tie_embeddings else None

    def full(name, shape):  # a tied head's copy starts as the embedding's matrix
        return full_init(EMBEDDING if name == copy else name, shape, seed, chunk.cfg) if full_of is None \
            else full_of(name, shape)

    for name, p in chunk.named_parameters():
        shape = tuple(p.shape)
        if isinstance(p, DTensor):  # --init-from reads the rank's block alone where it can (HFInit.local)
            local = full_of.local(name, shape, p.device_mesh, p.placements) if hasattr(full_of, "local") else None
            if local is None:
                local = distribute_tensor(full(name, shape), p.device_mesh, p.placements, src_data_rank=None).to_local()
            p.to_local().copy_(local)
        else:
            p.copy_(full(name, shape))
    chunk.init_buffers(next(iter(chunk.parameters())).device)
