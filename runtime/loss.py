"""The runtime's cross-entropy: vocabulary-parallel and light on memory.

Under tensor parallelism the head is split by vocabulary columns and each rank keeps its slice of
the logits, [tokens, vocab / tp]; the loss combines per-token statistics over the TP group with
two all-reduces (the row maximum, then the sum of exponentials together with the target's
logit), the scheme of Megatron-LM's vocab-parallel cross-entropy (Shoeybi et al. 2019, section
3). With one rank the same code runs without the all-reduces.

A target of IGNORE (training.eod_mask_loss: after an end-of-text id) adds no loss and no gradient;
the sum is divided by `tokens` where given, the share of the global batch's counted tokens a
micro-batch stands for (runtime.train: the same weight for every counted token, whatever the
plan), else by the micro-batch's tokens.

The gradient, (softmax - one-hot) / tokens, is computed in the forward, in float32, and kept in
the logits' dtype; nothing else is saved, and the backward only scales it by the incoming
gradient, in place (flash-attention's fused cross-entropy keeps its gradient in the logits'
buffer on the same idea). Between forward and backward a device holds e bytes per logit element
(2 in bf16), where F.cross_entropy(logits.float()) holds the float32 log-softmax (4) and peaks
at 12 bytes per bf16 logit in its backward. The float32 work runs on planner.model.LOSS_CHUNKS row
chunks through one reused buffer, so its transient is that fraction of the logits in float32.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from planner.model import LOSS_CHUNKS

IGNORE = -100  # a target that counts for nothing (torch's ignore_index)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group, vocab_start, scale, tokens):
        n, vocab_local = logits.shape
        norm = tokens or n
        grad = torch.empty_like(logits)
        rows = -(-n // LOSS_CHUNKS)
        buf = torch.empty((min(rows, n), vocab_local), dtype=torch.float32, device=logits.device)
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        for lo in range(0, n, rows):
            x = logits[lo:lo + rows]
            z = buf[:x.shape[0]]
            local = targets[lo:lo + rows] - vocab_start
            counted = (targets[lo:lo + rows] != IGNORE).float()
            mine = (local >= 0) & (local < vocab_local)  # the target's column is on this rank
            local = local.clamp(0, vocab_local - 1).unsqueeze(1)
            top = x.amax(-1).float()
            if group is not None:
                dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
            torch.sub(x, top.unsqueeze(1), out=z)  # float32 from the logits' dtype, one pass
            picked = torch.where(mine, z.gather(1, local).squeeze(1), 0.0)
            z.exp_()
            stats = torch.stack([z.sum(-1), picked])  # sum of exponentials, target logit - max
            if group is not None:
                dist.all_reduce(stats, group=group)
            total += ((stats[0].log() - stats[1]) * counted).sum()
            # exp - sum * one-hot, in float32 so that p - 1 keeps its digits when p is near 1
            z.scatter_add_(1, local, torch.where(mine, -stats[0], 0.0).unsqueeze(1))
            torch.mul(z, (scale * counted / (stats[0] * norm)).unsqueeze(1), out=grad[lo:lo + rows])
        ctx.save_for_backward(grad)
        return total / norm * scale

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        (grad,) = ctx.saved_tensors
        return grad.mul_(grad_output), None, None, None, None, None


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group=None, tp_rank: int = 0,
                  vocab: int | None = None, scale: float = 1.0, tokens: float | None = None) -> torch.Tensor:
    """Mean cross-entropy over the tokens of a micro-batch (the pipeline's loss_fn).

    `logits`: [batch, seq, vocab / tp], this rank's vocabulary slice (rank `tp_rank` of the TP
    `group` holds columns from tp_rank * ceil(vocab / tp), DTensor's split of a `vocab` that tp
    does not divide: the last ranks hold fewer; the whole vocabulary when `group` is None);
    `targets`: [batch, seq] token ids. Every rank of the group returns the same loss. `scale`: the
    loss and the gradient kept for the backward are scaled by it (fp16's loss scaling,
    runtime.loss_scale), the gradient before its cast to the logits' dtype. `tokens`: the divisor of
    the summed loss (module doc; None: the micro-batch's tokens)."""
    chunk = logits.shape[-1] if vocab is None or group is None else -(-vocab // dist.get_world_size(group))
    return _VocabParallelCrossEntropy.apply(logits.flatten(0, 1), targets.flatten(0, 1), group,
                                            tp_rank * chunk, scale, tokens)
