"""`trident tokenize`: text into the token files `trident run --data` reads (runtime.data).

    trident tokenize --tokenizer DIR INPUT... -o train.bin [--val-out val.bin --val-fraction 0.01]

DIR is a Hugging Face model directory (or its tokenizer.json): the `tokenizers` library encodes
with the model's own tokenizer, so a run started from the model's weights (--init-from DIR) reads
the ids it was trained on. An INPUT is a text file (one document) or a JSON-lines file (`.jsonl`:
one document an object, its text under --text-key). Each document's ids are followed by the
end-of-text id (--eos-id, else the directory's config.json eos_token_id or tokenizer_config.json
eos_token), as nanoGPT's prepare.py and Megatron-LM's preprocess_data.py --append-eod separate
documents. The ids go out as one flat file, uint16 where the vocabulary has at most 65,536 ids and
uint32 beyond, written as the documents stream by; beside it FILE.json says its dtype and
end-of-text id (which `run --data` reads: runtime.data.token_file_meta), documents and tokens.
Every round(1 / --val-fraction)-th document goes to --val-out instead: held-out documents for
`--eval-data`, not a slice of the training ones.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from planner.args import OneLineParser
from planner.model import ConfigError

BATCH = 256  # documents encoded at once (encode_batch runs them in parallel)
VAL_FRACTION = 0.01  # --val-fraction's default


def parse_args(argv=None) -> argparse.Namespace:
    ap = OneLineParser(prog="trident tokenize", description=__doc__.splitlines()[0].split(": ", 1)[1])
    ap.add_argument("inputs", nargs="+", metavar="INPUT", help="text files (one document each) or .jsonl files")
    ap.add_argument("--tokenizer", required=True, help="a Hugging Face model directory or its tokenizer.json")
    ap.add_argument("-o", "--out", required=True, help="the token file to write (training data)")
    ap.add_argument("--val-out", default=None, help="a token file of held-out documents (validation data)")
    ap.add_argument("--val-fraction", type=float, default=None,
                    help=f"documents held out for --val-out (default {VAL_FRACTION})")
    ap.add_argument("--text-key", default="text", help="the text's key in a .jsonl object (default text)")
    ap.add_argument("--eos-id", type=int, default=None, help="the id after each document (default: the model's)")
    return ap.parse_args(argv)


def load_tokenizer(spec: str):
    from tokenizers import Tokenizer
    path = Path(spec)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(f"--tokenizer: {file} is not a file; give a model directory with tokenizer.json or the file")
    try:
        return Tokenizer.from_file(str(file)), file.parent
    except Exception as exc:  # the Rust library's own error
        raise ConfigError(f"--tokenizer: {file} is not a tokenizers file ({exc})") from None


def end_of_text(tok, directory: Path, given: int | None) -> int:
    """The id that ends each document: given, or the model's (config.json, tokenizer_config.json)."""
    vocab = tok.get_vocab_size(with_added_tokens=True)
    if given is not None:
        if not 0 <= given < vocab:
            raise ConfigError(f"--eos-id: {given} is not an id of this tokenizer (0..{vocab - 1})")
        return given
    for name, key in (("config.json", "eos_token_id"), ("generation_config.json", "eos_token_id"),
                      ("tokenizer_config.json", "eos_token")):
        try:
            value = json.loads((directory / name).read_text()).get(key)
        except (OSError, ValueError, AttributeError):
            continue
        value = value[0] if isinstance(value, list) and value else value
        value = value.get("content") if isinstance(value, dict) else value  # an AddedToken's form
        eos = tok.token_to_id(value) if isinstance(value, str) else value
        if isinstance(eos, int) and 0 <= eos < vocab:
            return eos
    raise ConfigError(f"--eos-id: {directory} names no end-of-text token (config.json eos_token_id, "
                      "tokenizer_config.json eos_token); give its id")


def documents(paths: list[str], text_key: str):
    """(where, text) of every document of the inputs, in order."""
    for p in map(Path, paths):
        if not p.is_file():
            raise ConfigError(f"{p}: not a file; give text files or .jsonl files")
        try:
            if p.suffix != ".jsonl":
                yield str(p), p.read_text(encoding="utf-8")
                continue
            with p.open(encoding="utf-8") as fh:
                for n, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    try:
                        text = json.loads(line)[text_key]
                    except (ValueError, KeyError, TypeError):
                        raise ConfigError(f"{p}:{n}: not a JSON object with a string under {text_key!r} "
                                          "(--text-key)") from None
                    if not isinstance(text, str):
                        raise ConfigError(f"{p}:{n}: {text_key!r} is not a string")
                    yield f"{p}:{n}", text
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{p}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def tokenize(args) -> dict:
    if args.val_fraction is not None and not args.val_out:
        raise ConfigError("--val-fraction: only with --val-out (the file the held-out documents go to); give it")
    fraction = VAL_FRACTION if args.val_fraction is None else args.val_fraction
    if not 0 <= fraction < 1:
        raise ConfigError(f"--val-fraction: {fraction} must be at least 0 and below 1")
    tok, directory = load_tokenizer(args.tokenizer)
    eos = end_of_text(tok, directory, args.eos_id)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    dtype = np.uint16 if vocab <= 2**16 else np.uint32
    every = round(1 / fraction) if args.val_out and fraction > 0 else 0
    outs = {"train": Path(args.out)}
    if every:
        outs["val"] = Path(args.val_out)
        if outs["val"].resolve() == outs["train"].resolve():
            raise ConfigError(f"--val-out: {args.val_out} is -o's file too; name another")
    inputs = {Path(p).resolve() for p in args.inputs}
    for split, out in outs.items():  # the outputs are opened (emptied) before any input is read
        for path in (out, Path(f"{out}.json")):
            if path.resolve() in inputs:
                raise ConfigError(f"{'-o' if split == 'train' else '--val-out'}: {path} is an INPUT file, which "
                                  "writing it would destroy; name another")
    counts = {k: {"documents": 0, "tokens": 0} for k in outs}
    files, done = {}, False
    try:
        files = {k: p.open("wb") for k, p in outs.items()}
        batch, index = [], 0

        def flush():
            for (split, _), enc in zip(batch, tok.encode_batch([t for _, t in batch], add_special_tokens=False)):
                ids = np.asarray(enc.ids + [eos], dtype=dtype)
                ids.tofile(files[split])
                counts[split]["documents"] += 1
                counts[split]["tokens"] += len(ids)
            batch.clear()
        for _, text in documents(args.inputs, args.text_key):
            index += 1
            batch.append(("val" if every and index % every == 0 else "train", text))
            if len(batch) == BATCH:
                flush()
        flush()
        if counts["train"]["documents"] == 0:
            raise ConfigError("INPUT: no documents" + (" left for training (lower --val-fraction)" if index else ""))
        for k, out in outs.items():  # beside each file, what runtime.data.token_file_meta reads
            Path(f"{out}.json").write_text(json.dumps({"dtype": np.dtype(dtype).name, "eos_id": eos, **counts[k],
                                                       "tokenizer": str(args.tokenizer)}, indent=1) + "\n")
        done = True
    except OSError as exc:
        raise ConfigError(f"-o: cannot write {exc.filename or ''} ({exc.strerror or exc})") from None
    finally:
        for fh in files.values():
            fh.close()
        if not done:  # no half-written token file left to train on
            for k in files:
                outs[k].unlink(missing_ok=True)
                Path(f"{outs[k]}.json").unlink(missing_ok=True)
    return {"eos": eos, "vocab": vocab, "dtype": np.dtype(dtype).name, "counts": counts,
            "outs": {k: str(p) for k, p in outs.items()}}


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
        done = tokenize(args)
    except ConfigError as exc:
        print(f"trident: error: {exc}", file=sys.stderr)
        return 2
    for split, c in done["counts"].items():
        print(f"{split}: {c['documents']:,} documents, {c['tokens']:,} tokens ({done['dtype']}, end-of-text id "
              f"{done['eos']}) in {done['outs'][split]}")
    flags = f"--data {done['outs']['train']}" + (f" --eval-data {done['outs']['val']}" if "val" in done["outs"] else "")
    print(f"vocabulary of {done['vocab']:,} ids (the model's vocab must be at least that); train with: "
          f"trident run PLAN {flags}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
