"""The runtime's cross-entropy (runtime/loss.py): the loss and gradient of F.cross_entropy on
float32 logits, and the memory the planner counts for it (ModelConfig.loss_bytes). The TP
(vocabulary-parallel) path is checked by the multi-rank runs of tests/test_runtime.py."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from planner.model import LOSS_CHUNKS, ZOO
from runtime.loss import cross_entropy
from runtime.metrics import LiveTensorBytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [7, 64])
def test_loss_and_gradient_are_those_of_float32_cross_entropy(dtype, tokens):
    g = torch.Generator().manual_seed(tokens)
    base = (4 * torch.randn(2, tokens, 301, generator=g)).to(dtype)
    targets = torch.randint(0, 301, (2, tokens), generator=g)
    targets[0, 0] = base[0, 0].float().argmax()  # a confident row: p - 1 near zero keeps its digits
    base[0, 0, targets[0, 0]] += 30
    ours, ref = base.clone().requires_grad_(), base.clone().requires_grad_()
    loss = cross_entropy(ours, targets)
    (loss / 3).backward()  # a scaled loss, as gradient accumulation runs it
    expected = F.cross_entropy(ref.flatten(0, 1).float(), targets.flatten())
    (expected / 3).backward()
    assert ours.grad.dtype == dtype
    assert float(loss.detach()) == pytest.approx(float(expected.detach()), rel=1e-6)
    ulp = 1e-6 if dtype == torch.float32 else 2 ** -7  # one bf16 rounding of the scale
    torch.testing.assert_close(ours.grad.float(), ref.grad.float(), rtol=ulp, atol=ulp * float(ref.grad.abs().max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_loss_holds_and_allocates_what_the_planner_counts(dtype):
    cfg = dataclasses.replace(ZOO["llama3-8b"], vocab=1000)
    b, s = 3, 50  # 150 tokens: chunks of 38 rows, the last one shorter
    e = torch.tensor([], dtype=dtype).element_size()
    logits = torch.randn(b, s, cfg.vocab, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, cfg.vocab, (b, s))
    counter = LiveTensorBytes()
    counter.track(logits)
    counter.track(targets)
    base = counter.current_bytes
    with counter:
        loss = cross_entropy(logits, targets)
        held = counter.current_bytes - base
    held_planned, transient_planned = cfg.loss_bytes(b, s, 1, e)
    assert held - 4 == held_planned  # the gradient, and the float32 loss itself
    chunk = 4 * -(-b * s // LOSS_CHUNKS) * cfg.vocab
    assert transient_planned == e * b * s * cfg.vocab + chunk  # the logits and the chunk buffer
    # the peak of what the loss allocates: the gradient and one float32 chunk, plus per-row statistics
    assert held_planned + chunk <= counter.peak_bytes - base <= held_planned + chunk + 64 * b * s
    loss.backward()
    assert logits.grad.shape == logits.shape
