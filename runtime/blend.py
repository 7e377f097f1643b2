"""Blended data: several token files mixed by weight (`--data a.bin:0.7,b.bin:0.3`).

As Megatron-LM's `--data-path 0.7 a 0.3 b` does: each sample of the run comes from one file, in
the proportions of the weights, and each file is read in epochs of its own (runtime.data:
windows of seq_len + 1 tokens, every window once an epoch, its own shuffle). The files take turns
by a fixed pattern of PERIOD samples, repeated: file d has round(w_d x PERIOD) places in it
(largest remainders, so that the places add up), its i-th at the point (i + 1/2) / places_d of
the period, so the files interleave evenly, as Megatron-LM's blending (the file furthest below
its share goes next) spreads them. Sample k is then the (k // PERIOD) x places_d + (its rank among
file d's places of the period)-th sample of its file: computed, not stored, and the batch of a
step depends on the seed and the step alone (a resumed run reads what an unbroken one would).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from planner.model import ConfigError
from runtime.data import TokenFileData, token_file_meta

PERIOD = 10_000  # samples in the repeated pattern: weights count in steps of 1 / PERIOD


def parse_blend(spec: str) -> list[tuple[str, float]] | None:
    """`FILE:WEIGHT,FILE:WEIGHT,...` -> [(file, weight), ...]; None for a single file without a
    weight (a path that exists is a file, whatever its name holds)."""
    if Path(spec).exists() or (":" not in spec and "," not in spec):
        return None
    parts = []
    for item in spec.split(","):
        path, _, weight = item.rpartition(":")
        try:
            w = float(weight)
        except ValueError:
            w = None
        if not path or w is None:
            raise ConfigError(f"--data: {item!r} gives no weight; blend files as FILE:WEIGHT,FILE:WEIGHT "
                              "(e.g. web.bin:0.7,code.bin:0.3)")
        if not w > 0 or w == float("inf"):
            raise ConfigError(f"--data: the weight of {path} is {weight}; give a positive number")
        parts.append((path, w))
    if not sum(w for _, w in parts) < float("inf"):
        raise ConfigError("--data: the weights sum past the largest float; give smaller ones (only their ratios "
                          "count, e.g. 0.7 and 0.3)")
    return parts


def places(weights: list[float]) -> np.ndarray:
    """Each file's places in the period: round(w x PERIOD) by largest remainders, at least one."""
    share = np.asarray(weights, dtype=float) / sum(weights) * PERIOD
    out = np.floor(share).astype(np.int64)
    out[np.argsort(-(share - out), kind="stable")[:PERIOD - int(out.sum())]] += 1
    return out


class BlendedData:
    """A source (runtime.data's interface: batch, describe, epochs) over weighted token files."""

    def __init__(self, parts: list[tuple[str, float]], seq_len: int, seed: int, vocab: int, dtype: str | None = None):
        self.files = [TokenFileData(p, seq_len, seed, vocab, dtype, stream=j + 1) for j, (p, _) in enumerate(parts)]
        self.places = places([w for _, w in parts])
        for (path, w), n in zip(parts, self.places):
            if n == 0:
                raise ConfigError(f"--data: the weight of {path} ({w:g}) is below 1/{PERIOD} of the total; raise it "
                                  "or leave the file out")
        points = np.concatenate([(np.arange(n) + 0.5) / n for n in self.places])
        owner = np.repeat(np.arange(len(self.files)), self.places)
        self.owner = owner[np.argsort(points, kind="stable")]  # the file of each place of the period
        # each place's rank among its file's places of the period
        self.rank = np.empty(PERIOD, dtype=np.int64)
        for d in range(len(self.files)):
            self.rank[self.owner == d] = np.arange(self.places[d])
        self.seq_len = seq_len

    def samples(self, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(file, that file's sample) of the run's samples `k`."""
        turn, r = np.divmod(np.asarray(k, dtype=np.int64), PERIOD)
        d = self.owner[r]
        return d, turn * self.places[d] + self.rank[r]

    def batch(self, step: int, global_batch: int) -> torch.Tensor:
        d, i = self.samples(np.arange(step * global_batch, (step + 1) * global_batch))
        out = torch.empty(global_batch, self.seq_len + 1, dtype=torch.int64)
        for j in np.unique(d):
            out[torch.from_numpy(d == j)] = self.files[j].rows(i[d == j])
        return out

    def read_by(self, samples: int) -> np.ndarray:
        """How many of the run's first `samples` samples each file gives."""
        turn, r = divmod(samples, PERIOD)
        return turn * self.places + np.bincount(self.owner[:r], minlength=len(self.files))

    def check_ids(self) -> None:
        """Every file's token ids below the model's vocabulary (runtime.data.TokenFileData.check_ids)."""
        for f in self.files:
            f.check_ids()

    def describe(self, global_batch: int) -> str:
        return "; ".join(f"{f.describe(global_batch * n / PERIOD)} ({n / PERIOD:.2%} of the samples)"
                         for f, n in zip(self.files, self.places))

    def epochs(self, samples: int) -> list[dict]:
        """Each file's share of the samples and epochs read by the run's first `samples` samples."""
        return [{"file": f.path, "share": float(p / PERIOD), "epochs": f.epochs(int(n))}
                for f, p, n in zip(self.files, self.places, self.read_by(samples))]


def blend_meta(parts: list[tuple[str, float]]) -> dict | None:
    """The end-of-text id the blend's files share (their side files, runtime.data.token_file_meta),
    or None where none says one; ConfigError where two differ."""
    ids = {p: m["eos_id"] for p, _ in parts if (m := token_file_meta(p)) and m.get("eos_id") is not None}
    if len(set(ids.values())) > 1:
        raise ConfigError(f"--data: the blend's files end their documents with different ids ({ids}); tokenize them "
                          "with one tokenizer")
    return {"eos_id": next(iter(ids.values()))} if ids else None
