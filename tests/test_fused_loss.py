"""The fused modes' loss: Megatron-LM's default cross-entropy (elementwise_kernels fused-fp32-loss)
runs on the CPU kernel by kernel under tests/test_pointwise.py's byte counter and moves the bytes
planner.pointwise prices for it."""
import pytest
import torch

from planner.pointwise import fused_bytes
from test_pointwise import _small, _traced


class _Fp32VocabCrossEntropy(torch.autograd.Function):
    """Megatron-LM's default loss as planner.pointwise's module doc lists its kernels (one TP rank, so
    no all-reduces): on float32 logits, the row maximum, subtracted in place, exp in place, the row
    sum, the in-place division into the softmax kept for backward; backward, the target's entry
    less one and the in-place product with the loss gradient."""

    @staticmethod
    def forward(ctx, logits, target):
        logits.sub_(logits.max(dim=-1)[0].unsqueeze(-1))
        picked = torch.gather(logits, -1, target.unsqueeze(-1)).squeeze(-1)
        torch.exp(logits, out=logits)
        total = logits.sum(dim=-1)
        logits.div_(total.unsqueeze(-1))
        ctx.save_for_backward(logits, target)
        return torch.log(total) - picked

    @staticmethod
    def backward(ctx, grad):
        softmax, target = ctx.saved_tensors
        softmax.scatter_add_(-1, target.unsqueeze(-1), -torch.ones_like(target, dtype=softmax.dtype).unsqueeze(-1))
        softmax.mul_(grad.unsqueeze(-1))
        return softmax, None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_megatrons_float32_loss_moves_what_fused_fp32_loss_prices(dtype):
    """elementwise_kernels fused-fp32-loss prices the head's loss kernel by kernel: traced, the
    float32 cast of the logits (none in float32), the loss and the cast's gradient back move it."""
    cfg = _small("llama3-8b")
    b, s, e = 8, 32, torch.tensor([], dtype=dtype).element_size()
    targets = torch.randint(0, cfg.vocab, (b, s))
    x = torch.randn(b, s, cfg.hidden, dtype=dtype, requires_grad=True)
    w = torch.randn(cfg.hidden, cfg.vocab, dtype=dtype) / cfg.hidden ** 0.5  # the logits' product, not counted
    fwd, bwd = _traced(lambda t: _Fp32VocabCrossEntropy.apply((t @ w).float(), targets), x)
    index = cfg.num_layers_total - 1
    norm = 2 * e * b * s * cfg.hidden  # the final norm's forward, 1.5x that backward (fused_bytes)
    pf, pb = fused_bytes(cfg, index, b, s, 1, False, e, False, "flash", fp32_loss=True)
    assert pf - norm == pytest.approx(fwd, rel=0.03) and pb - 1.5 * norm == pytest.approx(bwd, rel=0.03)
    plain = fused_bytes(cfg, index, b, s, 1, False, e, False, "flash")  # a fused loss: 2.5 (e + 8) bytes a logit
    assert (pf + pb - 2.5 * norm) / (plain[0] + plain[1] - 2.5 * norm) == pytest.approx(
        (52 if e == 2 else 40) / (25 if e == 2 else 30))
