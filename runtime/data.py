"""Training data: the global batch of step i is the same sequences whatever the plan.

A source returns the whole global batch of a step, `[global_batch, seq_len + 1]` token ids, from
(seed, step) alone; `local_rows` then cuts out a data-parallel rank's rows and `micro_batches`
splits those. The position of a source is the next step to read, so a checkpoint stores one
integer and a resumed run reads exactly the batches an uninterrupted run would.

A token file is read in epochs, as Megatron-LM's GPT dataset reads one: it is cut into windows of
seq_len + 1 tokens, window w starting at token w x seq_len (a window's last token, a target, is
the next one's first input), and sample k of the run (row r of step i: k = i x global_batch + r)
is window perm_e(k mod W) of epoch e = k // W, W windows in all, so that an epoch reads every
window once, in an order of its own. The permutation is a keyed Feistel network over the next
power of four at or above W, walked until it lands below W (Black and Rogaway 2002, "Ciphers with
arbitrary finite domains"): a window's place is computed, not stored, which a shuffle index of
the whole file would be (hundreds of MB a rank for 10^11 tokens).
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


_M64 = np.uint64(2**64 - 1)
FEISTEL_ROUNDS = 4  # Luby and Rackoff: four rounds of a random round function make a strong permutation


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer (Steele et al. 2014) on uint64 values: a well-spread hash."""
    with np.errstate(over="ignore"):
        x = (x + np.uint64(0x9E3779B97F4A7C15)) & _M64
        x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _M64
        x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _M64
        return x ^ (x >> np.uint64(31))


def shuffled(k: np.ndarray, n: int, key: int) -> np.ndarray:
    """The places of indices `k` (each below n) under the permutation of range(n) that `key` picks."""
    half = max(1, (max(n - 1, 1).bit_length() + 1) // 2)  # 4^half >= n
    low = np.uint64((1 << half) - 1)
    keys = _mix(np.array([(key * FEISTEL_ROUNDS + r) % 2**64 for r in range(FEISTEL_ROUNDS)], dtype=np.uint64))
    out = np.asarray(k, dtype=np.uint64).copy()
    todo = np.ones(out.shape, dtype=bool)
    while todo.any():  # cycle-walking: fewer than 4 rounds a value on average (the domain < 4 n)
        x = out[todo]
        left, right = x >> np.uint64(half), x & low
        for r in keys:
            left, right = right, left ^ (_mix(right ^ r) & low)
        out[todo] = (left << np.uint64(half)) | right
        todo &= out >= np.uint64(n)
    return out.astype(np.int64)


class TokenFileData:
    """A flat file of token ids (nanoGPT's train.bin): uint16 or uint32, memory-mapped, read in
    shuffled epochs of windows (module doc)."""

    def __init__(self, path: str, seq_len: int, seed: int, vocab: int, dtype: str | None = None, stream: int = 0):
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"--data: {path} is not a file; give a uint16/uint32 token file, a blend FILE:WEIGHT,... "
                              "or synthetic")
        meta = token_file_meta(path) or {}
        dtype = dtype or meta.get("dtype") or ("uint32" if p.suffix in (".u32", ".uint32") else "uint16")
        if dtype not in TOKEN_DTYPES:
            raise ConfigError(f"--data-dtype: {dtype!r}; use uint16 or uint32")
        size = np.dtype(TOKEN_DTYPES[dtype]).itemsize
        if p.stat().st_size < (seq_len + 2) * size:
            raise ConfigError(f"--data: {path} holds {p.stat().st_size // size} {dtype} tokens, fewer than one "
                              f"sequence of {seq_len + 1}")
        if p.stat().st_size % size:
            raise ConfigError(f"--data: {path} holds {p.stat().st_size} bytes, not a whole number of {dtype} tokens "
                              f"({size} bytes each): a truncated file, or give its --data-dtype")
        self.tokens = np.memmap(p, dtype=TOKEN_DTYPES[dtype], mode="r")
        self.path, self.seq_len, self.seed, self.vocab, self.stream = path, seq_len, seed, vocab, stream
        self.windows = (len(self.tokens) - 1) // seq_len  # W

    def windows_of(self, k: np.ndarray) -> np.ndarray:
        """The windows this file's samples `k` read (`stream`: a blend's file, runtime.blend, an order
        of its own)."""
        epoch, place = np.divmod(np.asarray(k, dtype=np.int64), self.windows)
        out = np.empty_like(place)
        for e in np.unique(epoch):
            key = (self.seed * 1_000_003 + int(e)) * 1_009 + self.stream
            out[epoch == e] = shuffled(place[epoch == e], self.windows, key)
        return out

    def rows(self, k: np.ndarray) -> torch.Tensor:
        """[len(k), seq_len + 1] token ids of this file's samples `k`."""
        s = self.seq_len
        out = torch.from_numpy(np.stack([self.tokens[w * s:w * s + s + 1]
                                         for w in self.windows_of(k).tolist()]).astype(np.int64))
        self._below_vocab(int(out.max()))
        return out

    def _below_vocab(self, top: int) -> None:
        if top >= self.vocab:
            raise ConfigError(f"--data: token id {top} of {self.path} is not below model.vocab={self.vocab}; "
                              "wrong --data-dtype or tokenizer")

    def check_ids(self, chunk: int = 1 << 24) -> None:
        """rows' check over every token a window holds, a chunk at a time (memory-mapped: 2 GiB of
        uint16 in 0.35 s from the page cache, else as fast as the disk reads): `trident run` asks
        before it launches the ranks, which would find a bad id only at the batch that reads it."""
        end = self.windows * self.seq_len + 1
        for i in range(0, end, chunk):
            self._below_vocab(int(self.tokens[i:min(i + chunk, end)].max()))

    def batch(self, step: int, global_batch: int) -> torch.Tensor:
        return self.rows(np.arange(step * global_batch, (step + 1) * global_batch))

    def describe(self, global_batch: int) -> str:
        return (f"{self.path}: {len(self.tokens):,} tokens, {self.windows:,} windows of {self.seq_len + 1}; an epoch "
                f"every {self.windows / global_batch:,.4g} steps")

    def epochs(self, samples: int) -> float:
        """Epochs of the file the run's first `samples` samples read."""
        return samples / self.windows


def source_meta(spec: str) -> dict | None:
    """What --data's side files say: a token file's (token_file_meta), a blend's shared
    end-of-text id (runtime.blend.blend_meta); None for synthetic data."""
    from runtime.blend import blend_meta, parse_blend
    parts = None if spec == "synthetic" else parse_blend(spec)
    return blend_meta(parts) if parts else token_file_meta(spec)


def make_source(spec: str, seq_len: int, seed: int, vocab: int, dtype: str | None = None):
    """--data's source: `synthetic`, a token file, or a blend of weighted files (runtime.blend)."""
    from runtime.blend import BlendedData, parse_blend
    if spec == "synthetic":
        return SyntheticData(vocab, seq_len, seed)
    parts = parse_blend(spec)
    if parts is not None:
        return BlendedData(parts, seq_len, seed, vocab, dtype)
    return TokenFileData(spec, seq_len, seed, vocab, dtype)


def local_rows(batch: torch.Tensor, dp_rank: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of data-parallel rank `dp_rank`: its contiguous block of rows."""
    n = batch.shape[0] // dp
    rows = batch[dp_rank * n:(dp_rank + 1) * n]
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
