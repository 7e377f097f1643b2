"""Dropout (training.dropout on the hidden states, training.attention_dropout on the attention
probabilities) with masks that do not depend on the plan.

Dropout falls where Megatron-LM's GPT puts it (--hidden-dropout and --attention-dropout, both 0.1
by default) and where planner.model counts its masks (Korthikanti et al. 2022, section 4.1): on
the embedding's output, on the attention probabilities, and on the output of each block's
attention and MLP before its residual add.

The three hidden-state masks are drawn a sequence at a time: a generator seeded with (seed, step,
layer, site, the sequence's row in the step's global batch) draws the sequence's whole
[seq_len, hidden] mask and a rank keeps the rows of the tokens it holds (its sequence-parallel
shard, its context-parallel chunks). Which element is dropped thus depends on the token, the
layer and the step, never on the plan: the tensor-parallel ranks of a replicated residual stream
drop the same elements, sequence shards drop different ones, recomputation drops again what the
forward dropped, and a run's losses match the one-process run's under any dp, tp, sp, cp, pp,
micro-batching, ZeRO level or recomputation (tests/test_dropout.py). The price: a rank draws
seq_len x hidden a sequence where it holds 1 / (tp cp) of them under SP and CP (one kernel writing
a byte an element, planner.pointwise.eager_dropout_bytes); the mask kept for the backward is the
rank's, one byte an element, as planned.

Attention-probability dropout runs inside the fused attention kernel (scaled_dot_product_attention's
dropout_p), whose mask covers a rank's heads and queries and cannot be cut from a whole one. The
device's generator is seeded before each call with (seed, step, layer, first row, tp rank, cp
rank): the same masks under any pipeline, ZeRO level or recomputation, other masks under another
tp, cp or micro-batch split. (On CPU the kernel runs torch's math path: planner.precision
CPU_MATH_DROPOUT_BYTES.)
"""
from __future__ import annotations

import torch

MASK64 = (1 << 64) - 1
EMBEDDING, ATTENTION_OUT, MLP_OUT, ATTENTION = range(4)  # the dropout sites of a layer


def mix(*parts: int) -> int:
    """A 63-bit seed from integers (SplitMix64's multiply-xorshift rounds, Steele et al. 2014)."""
    h = 0x9E3779B97F4A7C15
    for v in parts:
        h = ((h ^ (v & MASK64)) * 0xBF58476D1CE4E5B9) & MASK64
        h = ((h ^ (h >> 31)) * 0x94D049BB133111EB) & MASK64
        h ^= h >> 29
    return h >> 1


class Dropout:
    """A chunk's dropout on this rank: probabilities `p` (hidden states) and `attention_p`, the
    run's `seed`, the rows of the sequence its hidden states hold (`positions`: context-parallel
    chunks, then this rank's sequence shard; None: the whole sequence), and where its sequences sit
    in the step's global batch."""

    def __init__(self, p: float, attention_p: float, seed: int, seq_len: int, first_row: int,
                 positions: torch.Tensor | None, tp_rank: int, cp_rank: int, device: torch.device):
        self.p, self.attention_p, self.seed, self.seq_len, self.first_row = p, attention_p, seed, seq_len, first_row
        self.positions, self.tp_rank, self.cp_rank = positions, tp_rank, cp_rank
        self.gen = torch.Generator(device)  # the hidden masks'
        # the device's own generator, which scaled_dot_product_attention's dropout draws from
        self.device_gen = torch.default_generator if device.type == "cpu" else torch.cuda.default_generators[
            device.index if device.index is not None else torch.cuda.current_device()]
        self.step = self.micro = 0  # set before each step and each micro-batch's forward

    def key(self, rows: int) -> tuple[int, int, int]:
        """(step, first global row, rows) of the micro-batch a forward of `rows` sequences runs."""
        return self.step, self.first_row + self.micro * rows, rows

    def hidden(self, x: torch.Tensor, key: tuple, layer: int, site: int) -> torch.Tensor:
        """x [rows, local tokens, hidden] with the elements of its tokens' masks zeroed, the rest
        scaled by 1 / (1 - p)."""
        if self.p == 0:
            return x
        step, first, rows = key
        drop = torch.empty(x.shape, dtype=torch.bool, device=x.device)
        if drop.shape[0] != rows or drop.shape[1] != (self.seq_len if self.positions is None else len(self.positions)):
            raise RuntimeError(f"dropout: hidden states {tuple(x.shape)} for {rows} rows of this rank's tokens")
        for i in range(rows):
            self.gen.manual_seed(mix(self.seed, step, layer, site, first + i))
            if self.positions is None:
                drop[i].bernoulli_(self.p, generator=self.gen)
            else:
                whole = torch.empty(self.seq_len, x.shape[-1], dtype=torch.bool, device=x.device)
                torch.index_select(whole.bernoulli_(self.p, generator=self.gen), 0, self.positions, out=drop[i])
        return x.masked_fill(drop, 0.0) * (1.0 / (1.0 - self.p))

    def attention_core(self, core, key: tuple, layer: int):
        """`core(q, k, v)` with dropout on the attention probabilities, its generator seeded for
        this layer and micro-batch (a replay seeds it alike)."""
        if self.attention_p == 0:
            return core
        step, first, _ = key
        seed = mix(self.seed, step, layer, ATTENTION, first, self.tp_rank, self.cp_rank)

        def attend(q, k, v):
            self.device_gen.manual_seed(seed)
            return core(q, k, v, dropout_p=self.attention_p)
        return attend


def local_positions(seq_len: int, context_positions: torch.Tensor | None, sequence_parallel: bool, tp: int,
                    tp_rank: int, device: torch.device) -> torch.Tensor | None:
    """The sequence rows a rank's hidden states hold: its CP chunks (or the whole sequence), of
    which sequence parallelism keeps the tp_rank-th contiguous part; None for the whole sequence."""
    rows = context_positions if context_positions is not None else torch.arange(seq_len, device=device)
    if sequence_parallel and tp > 1:
        n = len(rows) // tp
        rows = rows[tp_rank * n:(tp_rank + 1) * n]
    return None if len(rows) == seq_len else rows.to(device)


def attach_dropout(chunks, plan, dp_rank: int, tp_rank: int, context, device: torch.device) -> None:
    """Give each chunk and its blocks the plan's dropout (nothing when training.dropout is 0);
    `context`: the rank's runtime.context_parallel.ContextParallel, or None."""
    from runtime.model import Block
    t = plan.training
    if t.dropout == 0 and t.attention_dropout_p == 0:
        return
    sp = plan.pipeline.stages[0].sequence_parallel  # the same on every stage (runtime.run_checks)
    positions = local_positions(t.seq_len, None if context is None else context.positions, sp, plan.mesh.tp,
                                tp_rank, device)
    first_row = dp_rank * (t.global_batch // plan.mesh.dp)
    for chunk in chunks:
        chunk.dropout = Dropout(t.dropout, t.attention_dropout_p, t.seed, t.seq_len, first_row, positions, tp_rank,
                                0 if context is None else context.chunks[0], device)
        for layer in chunk.layers.values():
            if isinstance(layer, Block):
                layer.dropout = layer.attention.dropout = chunk.dropout


def dropout_step(chunks, step: int) -> None:
    """Before step `step` (0-based): its masks."""
    for chunk in chunks:
        if chunk.dropout is not None:
            chunk.dropout.step = step
