"""Training data: the global batch of step i is the same sequences whatever the plan.

A source returns the whole global batch of a step, `[global_batch, seq_len + 1]` token ids, from
a generator seeded with (seed, step) alone; `local_rows` then cuts out a data-parallel rank's rows
and `micro_batches` splits those. The position of a source is the next step to read, so a
checkpoint stores one integer and a resumed run reads exactly the batches an uninterrupted run
would.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from planner.model import ConfigError
from planner.values import is_int

TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


def token_file_meta(path: str) -> dict | None:
    """What `trident tokenize` wrote beside token file `path` (PATH.json: its dtype, end-of-text
    id, documents and tokens), or None (synthetic data, or a file from elsewhere)."""
    side = Path(f"{path}.json")
    if path == "synthetic" or not side.is_file():
        return None
    try:
        meta = json.loads(side.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--data: {side} is not the JSON trident tokenize writes ({exc}); remove it or write it "
                          "again") from None
    eos = meta.get("eos_id") if isinstance(meta, dict) else None
    if not isinstance(meta, dict) or meta.get("dtype") not in TOKEN_DTYPES or not (eos is None or is_int(eos)):
        raise ConfigError(f"--data: {side} names no token dtype (uint16, uint32) and integer eos_id; remove it or run "
                          "trident tokenize again")
    return meta


def _generator(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + step) % (2**63))


class SyntheticData:
    """Learnable synthetic tokens: every row walks one fixed random cycle of distinct tokens
    (drawn once from `seed`) from a random starting point, so the next token is a function of
    the current one and the loss falls visibly."""

    def __init__(self, vocab: int, seq_len: int, seed: int):
        self.seq_len, self.seed = seq_len, seed
        self.cycle = torch.randperm(vocab, generator=_generator(seed, -1))[:min(vocab, 257)]

    def batch(self, step: int, global_batch: int) -> torch.Tensor:
        gen = _generator(self.seed, step)
        start = torch.randint(0, len(self.cycle), (global_batch, 1), generator=gen)
        idx = (start + torch.arange(self.seq_len + 1)) % len(self.cycle)
        return self.cycle[idx]


class TokenFileData:
    """A flat file of token ids (nanoGPT's train.bin): uint16 or uint32, memory-mapped. Row r of
    step i starts at a random offset drawn from the (seed, step) generator."""

    def __init__(self, path: str, seq_len: int, seed: int, vocab: int, dtype: str | None = None):
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"--data: {path} is not a file; give a token file or `synthetic`")
        meta = token_file_meta(path) or {}
        dtype = dtype or meta.get("dtype") or ("uint32" if p.suffix in (".u32", ".uint32") else "uint16")
        if dtype not in TOKEN_DTYPES:
            raise ConfigError(f"--data-dtype: {dtype!r}; use uint16 or uint32")
        size = np.dtype(TOKEN_DTYPES[dtype]).itemsize
        if p.stat().st_size < (seq_len + 2) * size:
            raise ConfigError(f"--data: {path} holds {p.stat().st_size // size} {dtype} tokens, fewer than one "
                              f"sequence of {seq_len + 1}")
        self.tokens = np.memmap(p, dtype=TOKEN_DTYPES[dtype], mode="r")
        self.seq_len, self.seed, self.vocab = seq_len, seed, vocab

    def batch(self, step: int, global_batch: int) -> torch.Tensor:
        gen = _generator(self.seed, step)
        starts = torch.randint(0, len(self.tokens) - self.seq_len - 1, (global_batch,), generator=gen)
        rows = np.stack([self.tokens[s:s + self.seq_len + 1] for s in starts.tolist()]).astype(np.int64)
        out = torch.from_numpy(rows)
        if int(out.max()) >= self.vocab:
            raise ConfigError(f"--data: token id {int(out.max())} is not below model.vocab={self.vocab}; "
                              "wrong --data-dtype or tokenizer")
        return out


def make_source(spec: str, seq_len: int, seed: int, vocab: int, dtype: str | None = None):
    if spec == "synthetic":
        return SyntheticData(vocab, seq_len, seed)
    return TokenFileData(spec, seq_len, seed, vocab, dtype)


def local_rows(batch: torch.Tensor, dp_rank: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of data-parallel rank `dp_rank`: its contiguous block of rows."""
    n = batch.shape[0] // dp
    rows = batch[dp_rank * n:(dp_rank + 1) * n]
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
