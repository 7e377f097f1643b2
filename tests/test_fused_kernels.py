"""The fused modes' kernels, run on the CPU: Megatron-LM's default cross-entropy (elementwise_kernels
fused-fp32-loss) kernel by kernel under tests/test_pointwise.py's byte counter moves the bytes
planner.pointwise prices for it; a block whose SwiGLU is one autograd function saving its input,
as Megatron-Core's, keeps what ModelConfig.activation_bytes counts for fused kernels."""
import pytest
import torch
import torch.nn.functional as F

from planner.pointwise import fused_bytes
from runtime.model import Block, rope_tables
from test_pointwise import _gpu_norms, _kept_bytes, _small, _traced


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


class _OneKernelSwiGLU(torch.autograd.Function):
    """SwiGLU as one kernel, the way Megatron-Core's SwiGLUFunction keeps it for its backward
    (megatron/core/fusions/fused_bias_swiglu.py): only its input, the gate and up outputs side by
    side; the backward recomputes silu(gate)."""

    @staticmethod
    def forward(ctx, gate_up):
        ctx.save_for_backward(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors[0].chunk(2, dim=-1)
        sig = torch.sigmoid(gate)
        return torch.cat((grad * up * sig * (1 + gate * (1 - sig)), grad * gate * sig), dim=-1)


class _FusedFeedForward(torch.nn.Module):
    """The runtime's SwiGLU MLP with its gate and up projections as one product, as Megatron-Core's
    linear_fc1, and the one-kernel SwiGLU between it and the second projection."""

    def __init__(self, mlp):
        super().__init__()
        self.fc1 = torch.nn.Linear(mlp.w1.in_features, 2 * mlp.w1.out_features, bias=False)
        self.w2 = mlp.w2

    def forward(self, x):
        return self.w2(_OneKernelSwiGLU.apply(self.fc1(x)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_one_kernel_swiglu_keeps_what_fused_kernels_count(dtype):
    """activation_bytes(fused_swiglu=True) is 3 ffn_hidden a token for the MLP's products (gate
    and up outputs, the second projection's input) where eager SwiGLU keeps 4; traced with
    saved-tensor hooks on the runtime's block, as it is and with that MLP swapped in (the whole
    block's count checked in float32: CPU attention in bf16 keeps 1.5% beyond the GPU kernel's)."""
    cfg = _small("llama3-8b")
    b, s, e = 4, 32, torch.tensor([], dtype=dtype).element_size()
    block = _gpu_norms(Block(cfg).to(dtype), cfg, dtype)
    cos, sin = rope_tables(cfg)
    x = torch.randn(b, s, cfg.hidden, dtype=dtype, requires_grad=True)
    kept = {}
    for fused in (False, True):
        if fused:
            block.feed_forward = _FusedFeedForward(block.feed_forward).to(dtype)
        kept[fused] = _kept_bytes(block, x, cos, sin)
        counted = cfg.activation_bytes(1, b, s, bytes_per_element=e, attention="flash", fused_swiglu=fused)
        if dtype == torch.float32:
            assert counted == pytest.approx(kept[fused], rel=0.01), (fused, counted, kept[fused])
    assert kept[False] - kept[True] == e * b * s * cfg.ffn_hidden
    assert cfg.activation_bytes(1, b, s, bytes_per_element=e) - cfg.activation_bytes(
        1, b, s, bytes_per_element=e, fused_swiglu=True) == e * b * s * cfg.ffn_hidden
