"""A vocabulary that TP does not divide (GPT-2's 50,257 on 2, 4 or 8 ranks) is split as DTensor
splits it, torch.chunk's way (ceil(vocab / tp) rows a rank, fewer on the last), where Megatron-LM
pads it: the runtime's embedding, head and vocab-parallel loss (runtime.loss) take the uneven
slices, so every plan trains the one-process model; the planner prices ceil(vocab / tp) rows, the
most a rank holds."""
from __future__ import annotations

import dataclasses

from planner.zoo import ZOO
from torchrun_helpers import assert_ok, assert_same_losses, losses_of, train, write_plan

ODD = dataclasses.replace(ZOO["tiny"], name="tiny-vocab-511", vocab=511)
ODD_TIED_GPT = dataclasses.replace(ZOO["tiny-gpt"], name="tiny-gpt-vocab-509", vocab=509, tie_embeddings=True)


def test_plans_split_an_odd_vocabulary_and_train_as_one_process(tmp_path):
    want = {}
    for cfg in (ODD, ODD_TIED_GPT):
        assert_ok(train(1, "--plan", write_plan(tmp_path, cfg.name, cfg), "--steps", 3,
                        "--out", tmp_path / f"{cfg.name}.json"))
        want[cfg.name] = losses_of(tmp_path / f"{cfg.name}.json")
    plans = [(ODD, write_plan(tmp_path, "tp4-sp", ODD, world=4, tp=4, sequence_parallel=True, micro_batch=4)),
             (ODD, write_plan(tmp_path, "dp2-tp2-zero3", ODD, world=4, tp=2, zero=3)),
             (ODD_TIED_GPT, write_plan(tmp_path, "gpt-tp4", ODD_TIED_GPT, world=4, tp=4, zero=1, micro_batch=4))]
    out = tmp_path / "runs"
    out.mkdir()
    assert_ok(train(4, "--plan", *(p for _, p in plans), "--steps", 3, "--out", out))
    for cfg, plan in plans:
        assert_same_losses(losses_of(out / f"{plan.stem}.json"), want[cfg.name], plan.stem)
