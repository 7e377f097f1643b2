"""Context parallelism (plan mesh.cp > 1): each sequence split over the cp ranks of a CP group,
keys and values all-gathered (Llama 3, Dubey et al. 2024, section 3.3.2; planner.comm.cp_comm
prices it).

Causal attention's work grows along the sequence, so the sequence is cut into 2 cp equal chunks
and CP rank i holds chunks i and 2 cp - 1 - i (the load balancing of Llama 3 and torchtitan):
every rank attends as many (query, key) pairs. A rank computes its own tokens all the way through;
each block all-gathers the K and V of the whole sequence (one collective, the two stacked, whose
backward reduce-scatters their gradients) and attends each of its two query chunks to the keys
before it (ContextParallel.attend). Positions (RoPE tables, GPT's learned positions) are the rank's own.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_gather_single_autograd
from torch.nn.attention.bias import causal_lower_right


def rank_positions(seq_len: int, cp: int, cp_rank: int) -> torch.Tensor:
    """Token positions CP rank `cp_rank` holds: chunks cp_rank and 2 cp - 1 - cp_rank of 2 cp."""
    n = seq_len // (2 * cp)
    first, second = cp_rank * n, (2 * cp - 1 - cp_rank) * n
    return torch.cat([torch.arange(first, first + n), torch.arange(second, second + n)])


class ContextParallel:
    """One rank's view of its CP group: its positions, and attention over the gathered K and V."""

    def __init__(self, group, cp: int, cp_rank: int, seq_len: int, device: torch.device):
        self.group, self.n = group, seq_len // (2 * cp)
        self.chunks = (cp_rank, 2 * cp - 1 - cp_rank)  # the sequence chunks this rank's queries are
        self.positions = rank_positions(seq_len, cp, cp_rank).to(device)
        gathered = torch.cat([rank_positions(seq_len, cp, r) for r in range(cp)])  # in rank order
        self.order = torch.argsort(gathered).to(device)  # gathered rows -> sequence order
        # built once, here: inside a step (under the runtime's memory accounting) torch refuses to
        # create the tensor subclass
        self.masks = [causal_lower_right(self.n, (c + 1) * self.n) for c in self.chunks]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0) -> torch.Tensor:
        """q, k, v [b, heads, local tokens, head_dim] -> attention output for the local queries.
        Each of the rank's two query chunks attends the keys up to its own end under the causal
        mask aligned to their last key (torch's causal_lower_right, which fused kernels take
        without materializing a mask): (i + 1) and (2 cp - i) chunks of keys, as many pairs on
        every rank."""
        kv = torch.stack([k, v]).permute(3, 0, 1, 2, 4).contiguous()  # [tokens, 2, b, heads, d]
        kv = all_gather_single_autograd(kv, 0, self.group)[self.order]  # along dim 0 only
        k, v = kv.permute(1, 2, 3, 0, 4).unbind(0)  # [b, heads, seq_len, d], sequence order
        n, outs = self.n, []
        for half, (c, mask) in enumerate(zip(self.chunks, self.masks)):
            end = (c + 1) * n
            outs.append(F.scaled_dot_product_attention(q[:, :, half * n:(half + 1) * n], k[:, :, :end], v[:, :, :end],
                                                       attn_mask=mask, dropout_p=dropout_p,
                                                       enable_gqa=q.shape[1] != k.shape[1]))
        return torch.cat(outs, dim=2)

    def local_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of rows `x` [rows, seq_len]."""
        return x[:, self.positions.to(x.device)].contiguous()


def apply_context_parallel(chunk, context: ContextParallel) -> None:
    """Attach `context` to a materialized chunk: its attention layers gather K and V over the CP
    group, its positions are the rank's (runtime.model.Transformer.positions)."""
    from runtime.model import Block
    chunk.positions = context.positions
    for layer in chunk.layers.values():
        if isinstance(layer, Block):
            layer.attention.context = context
    chunk.init_buffers(context.positions.device)
