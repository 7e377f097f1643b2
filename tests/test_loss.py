"""The runtime's cross-entropy (runtime/loss.py): the loss and gradient of F.cross_entropy on
float32 logits, and the memory the planner counts for it (ModelConfig.loss_bytes) and for the
vocabulary matrices around it. The TP (vocabulary-parallel) path is checked by the multi-rank runs
of tests/test_runtime.py."""
import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from planner.cluster import load_cluster
from planner.cost import estimate
from planner.model import LOSS_CHUNKS
from planner.plan import Plan
from planner.zoo import ZOO
from runtime.loss import IGNORE, cross_entropy
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


def test_ignored_targets_add_nothing_and_the_divisor_is_the_one_given():
    """training.eod_mask_loss: targets of IGNORE add no loss and no gradient; the sum is divided by
    `tokens` (the micro-batch's share of the global batch's counted tokens), as F.cross_entropy's
    summed loss over it."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(2, 16, 301, generator=g)
    targets = torch.randint(0, 301, (2, 16), generator=g)
    targets[0, 3] = targets[1, 0] = targets[1, 9] = IGNORE
    ours, ref = base.clone().requires_grad_(), base.clone().requires_grad_()
    loss = cross_entropy(ours, targets, tokens=11.5)
    loss.backward()
    expected = F.cross_entropy(ref.flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="sum") / 11.5
    expected.backward()
    assert float(loss.detach()) == pytest.approx(float(expected.detach()), rel=1e-6)
    torch.testing.assert_close(ours.grad, ref.grad, rtol=1e-6, atol=1e-7)
    assert float(ours.grad[0, 3].abs().sum()) == 0.0


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


def cpu_cluster(devices: int):
    """A cluster of `devices` whose runs are CPU runs (gloo: what the runtime keeps on CPU, e.g. its
    composite RMSNorm, planner.precision.decomposed_norm_bytes); memory does not depend on speed."""
    return dataclasses.replace(load_cluster("dgx-a100-80gb").shaped_as(1, devices), backend="gloo")


def test_a_vocabulary_heavy_pipeline_holds_what_the_planner_counts(tmp_path):
    """A two-stage GPipe pipeline of a model whose vocabulary matrices outweigh its blocks: the
    first rank peaks with its embedding's gradients and AdamW's temporaries, the last with four
    micro-batches' logits gradients (runtime.loss keeps only those; the stage drops its cached
    logits). Each rank's measured peak is at most the planner's, and within 10% of it."""
    from torchrun_helpers import assert_ok, train, write_plan
    cfg = dataclasses.replace(ZOO["tiny"], vocab=16000, seq_len=64)
    path = write_plan(tmp_path, "gpipe", cfg, world=2, pp=2, schedule="gpipe", global_batch=8, micro_batch=2)
    predicted = estimate(Plan.read(path), cpu_cluster(2)).breakdown
    assert_ok(train(2, "--plan", path, "--steps", 3, "--out", tmp_path / "run.json"))
    measured = json.loads((tmp_path / "run.json").read_text())["peak_memory_bytes_per_rank"]
    for rank, (want, got) in enumerate(zip(predicted["memory_per_pp_rank"], measured)):
        assert got <= want <= 1.10 * got, (rank, want, got)


@pytest.mark.parametrize("arch", ["llama", "gpt"])
def test_a_vocabulary_heavy_tp_plan_holds_what_the_planner_counts(tmp_path, arch):
    """TP 2 with sequence parallelism on a model whose vocabulary matrices outweigh its blocks
    (GPT: tied, with position embeddings). The embedding's gradient is each rank's vocabulary rows
    (runtime.parallelize.RowShardedEmbedding; under DTensor's own embedding every rank held the
    whole table's, 8 MB here where the planner counts 4), and a tied matrix is held once (the
    planner counted it twice) with its two gradients meeting at the end of the backward. Each
    rank's measured peak is within 2% above the planner's and within 10% below it. The llama
    plan peaks in the optimizer step, measured 1.0-1.1% above the prediction: its live tensors
    0.3% (the data loader's token buffers, 0.12 MiB), and the C heap run.json reads holds a few
    hundred KiB of Python and gloo state beside them that grows over the first steps. The GPT
    plan peaks where the tied matrix's two gradients meet, 0.8% above the prediction until the
    runtime all-reduced the norms' partial gradients itself (runtime.optim.reduce_partial_grads),
    1.6% since: 254 KB more at the same op, in four runs, where the reduction's own buffers are 9
    KB and freed before that step's backward begins: heap that is not tensors."""
    from torchrun_helpers import assert_ok, train, write_plan
    cfg = dataclasses.replace(ZOO["tiny"], vocab=16000, seq_len=64, arch=arch, tie_embeddings=arch == "gpt",
                              kv_heads=ZOO["tiny"].kv_heads if arch == "llama" else ZOO["tiny"].heads)
    path = write_plan(tmp_path, "tp2", cfg, world=2, tp=2, sequence_parallel=True, global_batch=8, micro_batch=2)
    predicted = estimate(Plan.read(path), cpu_cluster(2)).peak_memory_bytes
    assert_ok(train(2, "--plan", path, "--steps", 3, "--out", tmp_path / "run.json"))
    for rank, got in enumerate(json.loads((tmp_path / "run.json").read_text())["peak_memory_bytes_per_rank"]):
        assert got <= 1.02 * predicted and predicted <= 1.10 * got, (rank, predicted, got)


def test_zbv_puts_the_embedding_and_the_head_on_one_rank_and_holds_what_the_planner_counts(tmp_path):
    """ZB-V places the first and the last stage on rank 0 (a V), so on a model whose vocabulary
    matrices outweigh its blocks rank 0 carries both, and each stage's activations stay until its
    weight gradients (W), with what they start from held since its input gradients (I). Rank 0's
    measured peak is at most the planner's and within 15% of it; rank 1, which holds two blocks and
    little else, within 5% either way (the C heap's few hundred KiB of Python and gloo state)."""
    from torchrun_helpers import assert_ok, train, write_plan
    cfg = dataclasses.replace(ZOO["tiny"], vocab=16000, seq_len=64)
    path = write_plan(tmp_path, "zbv", cfg, world=2, pp=2, schedule="zbv", global_batch=8, micro_batch=2)
    plan = Plan.read(path)
    assert plan.stages_of_rank(0) == [0, 3] and plan.stages_of_rank(1) == [1, 2]
    predicted = estimate(plan, cpu_cluster(2)).breakdown["memory_per_pp_rank"]
    assert_ok(train(2, "--plan", path, "--steps", 3, "--out", tmp_path / "run.json"))
    measured = json.loads((tmp_path / "run.json").read_text())["peak_memory_bytes_per_rank"]
    assert measured[0] <= predicted[0] <= 1.15 * measured[0], (predicted, measured)
    assert abs(predicted[1] / measured[1] - 1) < 0.05, (predicted, measured)
