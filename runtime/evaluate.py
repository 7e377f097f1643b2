"""Validation loss during training (`--eval-every N`): every N steps, and after the last, the mean
loss over `--eval-batches` global batches, forward only, under the plan's own parallelism
(torch.distributed.pipelining's eval on a pipeline), without dropout and without touching the
model, the optimizer or the data of the training steps.

The batches are the same at every evaluation, so the figures compare along a run and across plans
(a run under any plan gives one process's figures, tests/test_evaluate.py): from `--eval-data`, a
held-out token file, its batches 0, 1, ...; or, training on synthetic data, more sequences of the
same synthetic language from generators the training batches never use. Training on a token file
without `--eval-data` is refused: those batches would be training data.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from planner.args import non_negative_int, positive_int
from planner.model import ConfigError

SYNTHETIC_HELD_OUT = -(2 ** 40)  # synthetic batches drawn from steps from here down: never a training step


def add_eval_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--eval-every", type=non_negative_int, default=0,
                    help="validation loss every N steps and after the last (default 0: never)")
    ap.add_argument("--eval-batches", type=positive_int, default=1, help="global batches a validation reads (default 1)")
    ap.add_argument("--eval-data", default=None,
                    help="a held-out uint16/uint32 token file (default: held-out synthetic data when --data is "
                         "synthetic; required with a token file)")


def check_eval_args(args, plan) -> None:
    """ConfigError (one line) on validation options that cannot run."""
    every, data = getattr(args, "eval_every", 0), getattr(args, "eval_data", None)
    if every and args.data != "synthetic" and not data:
        raise ConfigError(f"--eval-data: needed with --data {args.data}: give a held-out token file (batches of the "
                          "training file would be training data)")
    if data and not every:
        raise ConfigError("--eval-data needs --eval-every N (validate every N steps)")
    if data:  # a file, long enough for one sequence, in the dtype given
        from runtime.data import make_source
        t = plan.training
        from runtime.blend import parse_blend
        if data == "synthetic" or not (Path(data).is_file() or parse_blend(data)):
            raise ConfigError(f"--eval-data: {data} is not a file; give a held-out uint16/uint32 token file (or a "
                              "blend of them, FILE:WEIGHT,...)")
        try:
            make_source(data, t.seq_len, t.seed, plan.model.vocab, getattr(args, "data_dtype", None))
        except ConfigError as exc:  # the token-file checks name --data, the option they usually read
            raise ConfigError(str(exc).replace("--data:", "--eval-data:", 1)) from None


class Evaluator:
    """The validation batches of a run and its evaluations."""

    def __init__(self, args, plan):
        from runtime.data import make_source
        t = plan.training
        self.every, self.batches, self.last = args.eval_every, args.eval_batches, args.steps
        self.held_out = args.eval_data is None
        self.source = make_source(args.eval_data or "synthetic", t.seq_len, t.seed, plan.model.vocab, args.data_dtype)
        self.results: list = []

    def due(self, step: int) -> bool:
        """Whether to evaluate after step `step` (0-based)."""
        return bool(self.every) and ((step + 1) % self.every == 0 or step + 1 == self.last)

    def run(self, trainer, step: int) -> float:
        """The mean validation loss after step `step`, the same on every rank; recorded."""
        g = trainer.plan.training.global_batch
        total = 0.0
        for i in range(self.batches):
            try:
                batch = self.source.batch(SYNTHETIC_HELD_OUT - i if self.held_out else i, g)
            except ConfigError as exc:  # a token id past the vocabulary: the file is --eval-data's
                raise ConfigError(str(exc).replace("--data:", "--eval-data:", 1)) from None
            total += eval_loss(trainer, batch)
        loss = total / self.batches
        self.results.append({"step": step + 1, "loss": loss})
        return loss


def eval_loss(trainer, batch) -> float:
    """The mean loss of a global batch [global_batch, seq_len + 1], forward only, as Trainer.step
    computes it."""
    import torch

    from runtime.documents import set_micro
    from runtime.pipeline import run_schedule
    inputs, targets = trainer.local_batch(batch)
    n_micro, scale = trainer.plan.pipeline.micro_batches, trainer.scaler.scale
    with torch.no_grad(), trainer._autocast():
        if trainer.schedule is not None:
            losses = run_schedule(trainer.schedule, trainer.stage_ids, trainer.n_stages, inputs, targets, forward_only=True)
        else:
            losses = []
            for i, (x, y) in enumerate(zip(inputs.chunk(n_micro), targets.chunk(n_micro))):
                set_micro(trainer.chunks[0], i)
                losses.append(trainer.loss(trainer.chunks[0](x), y))
    return trainer.mean_loss(sum(float(l) for l in losses) / n_micro / scale)
