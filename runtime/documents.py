"""Document masks (plan training.document_mask): attention stays inside each document of a row.

A token file holds documents back to back, each ended by an end-of-text id (runtime.tokens), and
a row of the batch is a window of it. Without a mask a token attends to the ends of the documents
before its own in the row (nanoGPT's and Megatron-LM's default); with one it attends to its own
document's tokens alone (Megatron-LM's --reset-attention-mask; Llama 3 trained so, Dubey et al.
2024, section 3.2). A token's document is the count of end-of-text ids before it: an end-of-text
id closes its document, the token after it opens the next. Positions run on through the row
(Megatron-LM without --reset-position-ids): under RoPE attention depends on the distance between
tokens alone, so a document's logits are those it has alone at the row's start
(tests/test_documents.py); GPT's learned positions see where it starts, unless
training.reset_position_ids restarts them at 0 with each document (DocumentMask.positions: the
learned position rows, or the rotary tables' rows, of each token).

The mask is dense, [rows, 1, s, s]: 0 where a query attends a key, -inf elsewhere, in the compute
dtype, which torch's fused attention kernels take as it is (a boolean mask would be converted in
every layer, and every block would keep its own copy for the backward). A stage builds it once
per micro-batch, on the first block's call, and its blocks share it; the planner prices it
(planner.memory.document_mask_bytes) and the kernel computing every score of the s x s
(planner.layers.attention_core_hw_flops). With fewer key/value heads than query heads the
fused kernels take a mask only if the heads are repeated first (else the math kernel, which
materializes the scores; pytorch/pytorch#139586: enable_gqa on the flash kernel alone), so they
are (planner.layers.repeated_kv_bytes). Context parallelism's chunked attention takes no document
mask (planner.plan_checks refuses the plan).

The end-of-text id: `--eos-id`, else the one `trident tokenize` wrote beside the token file
(FILE.json, runtime.data.token_file_meta), else the eos_token_id of the --init-from model.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from planner.model import ConfigError


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """[rows, s] -> the document of each token in its row: the end-of-text ids before it."""
    ends = (tokens == eos_id).to(torch.int32)
    return ends.cumsum(1) - ends


class DocumentMask:
    """One micro-batch's mask, built in the first dtype asked for and kept for the others' calls."""

    def __init__(self, docs: torch.Tensor):
        self.docs, self.built = docs, {}

    def positions(self) -> torch.Tensor:
        """[rows, s]: each token's position in its document (0 at its first token)."""
        d, s = self.docs, self.docs.shape[1]
        at = torch.arange(s, device=d.device).expand_as(d)
        first = torch.ones_like(d, dtype=torch.bool)
        first[:, 1:] = d[:, 1:] != d[:, :-1]
        return at - torch.where(first, at, 0).cummax(1).values

    def __call__(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self.built:  # filled in place: one boolean [rows, s, s] beside it, no more
            d, s = self.docs, self.docs.shape[1]
            mask = torch.zeros(d.shape[0], s, s, dtype=dtype, device=d.device)
            mask.masked_fill_(d[:, :, None] != d[:, None, :], float("-inf"))
            mask.masked_fill_(torch.ones(s, s, dtype=torch.bool, device=d.device).triu_(1), float("-inf"))
            self.built[dtype] = mask.unsqueeze(1)
        return self.built[dtype]


def masked_attention(q, k, v, dropout_p: float = 0.0, mask: DocumentMask | None = None):
    """Attention of q [b, heads, s, d] to k, v [b, kv_heads, s, d] under a document mask."""
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask(q.dtype), dropout_p=dropout_p)


class Documents:
    """The documents of a rank's rows this step, shared by its chunks: set_rows after the rank's
    batch is cut (Trainer.local_batch), `micro` before each forward (set_micro)."""

    def __init__(self, eos_id: int, reset_positions: bool = False):
        self.eos_id, self.ids, self.micro, self.reset_positions = eos_id, None, 0, reset_positions

    def set_rows(self, inputs: torch.Tensor) -> None:
        self.ids = document_ids(inputs, self.eos_id)

    def mask(self, rows: int) -> DocumentMask:
        """The mask of the micro-batch of `rows` sequences the next forward runs."""
        return DocumentMask(self.ids[self.micro * rows:(self.micro + 1) * rows])


def set_micro(chunk, micro: int) -> None:
    """Before a chunk's forward of micro-batch `micro`: its dropout masks' and document mask's rows."""
    for part in (getattr(chunk, "dropout", None), getattr(chunk, "documents", None)):
        if part is not None:
            part.micro = micro


def end_of_text(plan, args, meta: dict | None) -> int | None:
    """The end-of-text id a run masks documents (or the loss after it) by: --eos-id, else the
    token file's; None where the plan needs none. ConfigError (one line) where it needs one and
    none is known."""
    given, t = getattr(args, "eos_id", None), plan.training
    field = "document_mask" if t.document_mask else "eod_mask_loss" if t.eod_mask_loss else None
    if field is None:
        if given is not None:
            raise ConfigError("--eos-id: the plan has no document mask nor loss mask (training.document_mask, "
                              "eod_mask_loss false); plan with --document-mask or --eod-mask-loss, or leave --eos-id out")
        return None
    eos = given if given is not None else (meta or {}).get("eos_id")
    if eos is None:
        eos = model_eos(getattr(args, "init_from", None))
    if eos is None:
        raise ConfigError(f"training.{field}: the plan masks by documents but no end-of-text id is known; pass "
                          "--eos-id (trident tokenize writes it beside its token files, FILE.json)")
    if not 0 <= eos < plan.model.vocab:
        raise ConfigError(f"--eos-id: {eos} is not a token id of the model (0..{plan.model.vocab - 1})")
    return eos


def model_eos(directory: str | None) -> int | None:
    """The eos_token_id of the --init-from model's config.json (a list's first), or None."""
    if not directory:
        return None
    try:
        eos = json.loads((Path(directory) / "config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return None
    eos = eos[0] if isinstance(eos, list) and eos else eos
    return eos if isinstance(eos, int) and not isinstance(eos, bool) else None


def synthetic_note(source, eos_id: int) -> str | None:
    """What a document mask does to the synthetic language (runtime.data.SyntheticData), whose
    rows walk one cycle of distinct tokens: the end-of-text id, if in the cycle, ends a document
    every len(cycle) tokens; else every row is one document."""
    cycle = getattr(source, "cycle", None)
    if cycle is None:
        return None
    if eos_id not in cycle.tolist():
        return (f"end-of-text id {eos_id} never occurs in the synthetic data: every row is one document (the "
                f"mask is the causal one); pick one of its ids, e.g. {int(cycle[0])}")
    return f"the synthetic data's documents are {len(cycle)} tokens long (end-of-text id {eos_id})"


def attach_documents(chunks, eos_id: int | None, reset_positions: bool = False) -> Documents | None:
    """Give every chunk one Documents (None: no document mask)."""
    docs = Documents(eos_id, reset_positions) if eos_id is not None else None
    for c in chunks:
        c.documents = docs
    return docs
