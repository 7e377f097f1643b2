"""Document masks (training.document_mask, runtime.documents): attention inside each document of a
packed row, the same losses under every plan, and the planner's price of the dense mask."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from planner.build import build_plan
from planner.cluster import load_cluster
from planner.configs import cp_degrees
from planner.cost import estimate
from planner.layers import attention_core_hw_flops
from planner.model import ConfigError
from planner.plan import Plan
from planner.search import search
from planner.zoo import ZOO
from runtime.documents import DocumentMask, attach_documents, document_ids, end_of_text, synthetic_note
from planner.cli import main as cli_main
from runtime.model import Transformer, init_weights
from runtime.train import main as train_main
from torchrun_helpers import assert_ok, assert_same_losses, losses_of, train, write_plan

EOS = 7
H100 = load_cluster("dgx-h100-80gb", nodes=1)


def test_a_token_belongs_to_the_document_its_end_of_text_id_closes():
    tokens = torch.tensor([[5, 7, 3, 3, 7, 2], [7, 7, 1, 2, 3, 4]])
    assert document_ids(tokens, EOS).tolist() == [[0, 0, 1, 1, 1, 2], [0, 1, 2, 2, 2, 2]]
    mask = DocumentMask(document_ids(tokens, EOS))
    assert mask.positions().tolist() == [[0, 1, 0, 1, 2, 0], [0, 0, 0, 1, 2, 3]]
    m = mask(torch.float32)
    assert m.shape == (2, 1, 6, 6) and mask(torch.float32) is m  # built once, shared by the blocks
    allowed = (m[0, 0] == 0).int().tolist()
    assert allowed == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [0, 0, 1, 0, 0, 0], [0, 0, 1, 1, 0, 0],
                       [0, 0, 1, 1, 1, 0], [0, 0, 0, 0, 0, 1]]
    assert torch.isinf(m[0, 0][m[0, 0] != 0]).all() and mask(torch.bfloat16).dtype == torch.bfloat16


def test_the_run_says_what_a_mask_does_to_synthetic_data(tmp_path):
    from runtime.data import SyntheticData, TokenFileData
    src = SyntheticData(512, 32, 0)
    absent = min(set(range(512)) - set(src.cycle.tolist()))
    assert "documents are 257 tokens long" in synthetic_note(src, int(src.cycle[5]))
    assert f"{absent} never occurs in the synthetic data: every row is one document" in synthetic_note(src, absent)
    assert synthetic_note(TokenFileData(str(_token_file(tmp_path / "t.bin")), 32, 0, 512), EOS) is None


def _logits(model, rows, eos=None, reset=False):
    attach_documents([model], eos, reset)
    if eos is not None:
        model.documents.set_rows(rows)
    with torch.no_grad():
        return model(rows)


@pytest.mark.parametrize("name", ["tiny", "tiny-gpt"])
def test_a_masked_document_sees_nothing_of_the_documents_before_it(name):
    """Under RoPE (tiny: grouped-query heads, repeated for the mask) a document's logits in a
    packed row are those it has alone; under GPT's learned positions they depend on where it
    starts, but not on what came before. Without the mask both see the earlier document."""
    cfg = ZOO[name]
    model = Transformer(cfg)
    init_weights(model, 0)
    gen = torch.Generator().manual_seed(0)
    first, other = (torch.randint(8, cfg.vocab, (1, 10), generator=gen) for _ in range(2))
    first[0, -1] = other[0, -1] = EOS
    second = torch.randint(8, cfg.vocab, (1, 22), generator=gen)
    row, row2 = torch.cat([first, second], 1), torch.cat([other, second], 1)
    masked, plain = _logits(model, row, EOS), _logits(model, row)
    assert torch.allclose(masked[:, :10], plain[:, :10])  # the first document: causal alike
    assert torch.allclose(_logits(model, row2, EOS)[:, 10:], masked[:, 10:], atol=1e-5)
    assert (_logits(model, row2)[:, 10:] - plain[:, 10:]).abs().max() > 1e-2
    if cfg.arch == "llama":
        assert torch.allclose(masked[:, 10:], _logits(model, second, EOS), atol=1e-5)
        assert (plain[:, 10:] - _logits(model, second)).abs().max() > 1e-2
    else:  # learned positions: the document's own, 0 at its start, only where they restart
        assert (masked[:, 10:] - _logits(model, second, EOS)).abs().max() > 1e-2
    reset = _logits(model, row, EOS, reset=True)  # training.reset_position_ids: alone, either family
    assert torch.allclose(reset[:, 10:], _logits(model, second, EOS, reset=True), atol=1e-5)
    assert torch.allclose(reset[:, :10], masked[:, :10])


def _token_file(path, n=4000, seed=0):
    """Documents of 3 to 20 random ids, each ended by EOS, and the side file tokenize writes."""
    rng, ids = np.random.default_rng(seed), []
    while len(ids) < n:
        ids += rng.integers(8, 512, rng.integers(3, 21)).tolist() + [EOS]
    np.asarray(ids, dtype=np.uint16).tofile(path)
    path.with_name(path.name + ".json").write_text(json.dumps({"dtype": "uint16", "eos_id": EOS}))
    return path


def test_masked_plans_train_as_one_process(tmp_path):
    """A document-masked model, its positions reset per document, without loss after end of text
    (eod_mask_loss: every counted token weighted alike over the global batch, however ranks and
    micro-batches split it) trains to one process's losses (and validation losses) under tp 2 with
    SP, a 1F1B pipeline with selective recompute, ZB-V with full recompute (a replayed forward) and
    dp 2 under ZeRO 3 with micro-batches of one; its losses differ from those without the loss
    mask, and those from those without either."""
    data, val = _token_file(tmp_path / "train.bin"), _token_file(tmp_path / "val.bin", seed=1)
    d = tmp_path / "plans"
    d.mkdir()
    masked = dict(document_mask=True, eod_mask_loss=True, reset_position_ids=True)
    ref, plain = write_plan(d, "ref", **masked), write_plan(d, "plain")
    mask_only = write_plan(d, "mask-only", document_mask=True)
    two = [write_plan(d, "tp2-sp", world=2, tp=2, sequence_parallel=True, **masked),
           write_plan(d, "pp2-1f1b", world=2, pp=2, schedule="1f1b", recompute="selective", **masked),
           write_plan(d, "pp2-zbv", world=2, pp=2, schedule="zbv", recompute="full", micro_batch=1, **masked),
           write_plan(d, "dp2-zero3", world=2, zero=3, micro_batch=1, **masked)]
    flags = ("--steps", 3, "--data", data, "--eval-data", val, "--eval-every", 3, "--out", tmp_path)
    assert_ok(train(1, "--plan", ref, plain, mask_only, *flags))
    assert_ok(train(2, "--plan", *two, *flags))
    want = losses_of(tmp_path / "ref.json")
    for other in ("plain", "mask-only"):
        assert all(abs(a - b) > 1e-4 for a, b in zip(want, losses_of(tmp_path / f"{other}.json"))), other
    assert all(abs(a - b) > 1e-4 for a, b in zip(losses_of(tmp_path / "plain.json"),
                                                losses_of(tmp_path / "mask-only.json")))
    # step 1's loss is the initial model's mean over the counted tokens of the global batch
    from runtime.data import TokenFileData
    t = Plan.read(ref).training
    batch = TokenFileData(str(data), t.seq_len, t.seed, ZOO["tiny"].vocab).batch(0, t.global_batch)
    model = Transformer(ZOO["tiny"])
    init_weights(model, t.seed)
    inputs, targets = batch[:, :-1], batch[:, 1:].masked_fill(batch[:, :-1] == EOS, -100)
    logits = _logits(model, inputs, EOS, reset=True)
    first = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    assert want[0] == pytest.approx(float(first) / int((targets != -100).sum()), rel=1e-5)
    val_of = lambda p: json.loads((tmp_path / f"{p.stem}.json").read_text())["validation"][0]["loss"]  # noqa: E731
    for p in two:
        assert_same_losses(losses_of(tmp_path / f"{p.stem}.json"), want, p.stem)
        assert_same_losses([val_of(p)], [val_of(ref)], f"{p.stem} validation")


def test_the_runtime_needs_an_end_of_text_id_and_a_mask_to_use_it(tmp_path, capsys):
    masked, plain = write_plan(tmp_path, "masked", document_mask=True), write_plan(tmp_path, "plain")
    data = _token_file(tmp_path / "t.bin")

    def error(main, *argv) -> str:  # before any process group: one line, exit status 2
        assert main(list(map(str, argv))) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1, err
        return err
    assert "training.document_mask: the plan masks by documents but no end-of-text id" in error(train_main, "--plan", masked)
    assert "--eos-id: the plan has no document mask" in error(train_main, "--plan", plain, "--eos-id", 3)
    assert "--eos-id: 512 is not a token id" in error(train_main, "--plan", masked, "--eos-id", 512)
    (tmp_path / "t.bin.json").write_text('{"dtype": "int8"}')
    assert "t.bin.json names no token dtype" in error(train_main, "--plan", masked, "--data", data)
    # where none is given nor beside the data: the --init-from model's eos_token_id (a list's first)
    from types import SimpleNamespace
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text('{"eos_token_id": [9, 10]}')
    t = Plan.read(masked)
    assert end_of_text(t, SimpleNamespace(eos_id=None, init_from=str(tmp_path / "m")), None) == 9
    assert end_of_text(t, SimpleNamespace(eos_id=None, init_from=str(tmp_path / "m")), {"eos_id": 5}) == 5
    assert end_of_text(t, SimpleNamespace(eos_id=3, init_from=str(tmp_path / "m")), {"eos_id": 5}) == 3
    assert "--cp: a document mask is a dense s x s mask" in error(
        cli_main, "search", "--model", "llama3-8b", "--cluster", "dgx-h100-80gb", "--nodes", "1", "--global-batch", 8,
        "--cp", 2, "--document-mask")


def _plan(model="llama3-8b", **kw):
    kw = dict(dict(global_batch=8, micro_batch=1, seq_len=4096, tp=2, pp=1, dp=4), **kw)
    return build_plan(ZOO[model], cluster_name=H100.name, device=H100.device.name, nodes=1, devices_per_node=8, **kw)


def test_the_plan_prices_every_score_and_the_mask():
    """A fused kernel under an explicit mask computes every block of the scores (twice the
    causal half); each micro-batch in flight holds its [rows, 1, s, s] mask in the compute dtype,
    and with grouped-query heads each block keeps K and V repeated to the query heads."""
    m = ZOO["llama2-7b"]  # as many K/V heads as query heads: the mask alone
    f, b = attention_core_hw_flops(m, 1, 4096, "flash")
    assert attention_core_hw_flops(m, 1, 4096, "flash", masked=True) == (2 * f, 2 * b)
    assert attention_core_hw_flops(m, 1, 4096, "unfused", masked=True) == attention_core_hw_flops(m, 1, 4096, "unfused")
    for model, repeated in (("llama2-7b", 0), ("llama3-8b", 2 * 2 * 4096 * (4096 - 1024) / 2)):
        a, z = (estimate(_plan(model, document_mask=dm), H100) for dm in (False, True))
        extra = z.breakdown["memory"]["activations_bytes"] - a.breakdown["memory"]["activations_bytes"]
        assert extra == pytest.approx(2 * 4096 ** 2 + ZOO[model].layers * repeated, rel=1e-9), model
        assert z.breakdown["time"]["compute_s"] > a.breakdown["time"]["compute_s"]
    # a plan without the mask writes no field: older plans read and hash as before
    plain, masked = _plan(), _plan(document_mask=True)
    assert "document_mask" not in plain.to_dict()["training"]
    assert Plan.from_dict(json.loads(json.dumps(masked.to_dict()))).training.document_mask is True


def test_context_parallelism_takes_no_document_mask():
    with pytest.raises(ConfigError, match=r"training.reset_position_ids: true needs training.document_mask true"):
        _plan(reset_position_ids=True).validate()
    with pytest.raises(ConfigError, match=r"training.document_mask: true with mesh.cp=2.*set mesh.cp to 1"):
        _plan(dp=2, cp=2, document_mask=True).validate()
    assert cp_degrees(131072) != [1] and cp_degrees(131072, document_mask=True) == [1]  # what the search tries
    found = search(ZOO["llama3-8b"], load_cluster("dgx-h100-80gb", nodes=2), global_batch=16, seq_len=8192,
                   top=5, document_mask=True)
    assert found.results and all(f.plan.training.document_mask for f in found.results)
    best = found.results[0]
    again = estimate(best.plan, load_cluster("dgx-h100-80gb", nodes=2))  # the search's memory is the estimate's
    assert again.peak_memory_bytes == pytest.approx(best.estimate.peak_memory_bytes, rel=1e-6)
    unmasked = estimate(dataclasses.replace(best.plan, training=dataclasses.replace(best.plan.training,
                                                                                  document_mask=False)),
                        load_cluster("dgx-h100-80gb", nodes=2))
    assert again.peak_memory_bytes > unmasked.peak_memory_bytes
