"""`trident tokenize` (runtime.tokens): text through a Hugging Face tokenizer into the token files
`trident run --data` and `--eval-data` read."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from runtime.data import TokenFileData
from runtime.tokens import main
from torchrun_helpers import assert_ok, losses_of, train, write_plan

TEXTS = ["the quick brown fox jumps over the lazy dog. " * 4, "pack my box with five dozen liquor jugs. " * 4,
         "how vexingly quick daft zebras jump! " * 4, "sphinx of black quartz, judge my vow. " * 4]


@pytest.fixture
def model_dir(tmp_path):
    """A model directory with a byte-level BPE tokenizer of 300 ids, its end of text named in
    tokenizer_config.json (as Llama's and GPT-2's are)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<eos>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    d = tmp_path / "model"
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<eos>", "special": True}}))
    return d


def test_documents_become_ids_and_end_of_text_in_a_train_and_a_held_out_file(model_dir, tmp_path, capsys):
    """Two text files and a JSON-lines file of two documents (a blank line between): every second
    document is held out (--val-fraction 0.5), each document's ids followed by <eos>, as the
    tokenizer encodes it; a tiny model trains on the files and validates on the held-out one."""
    (tmp_path / "a.txt").write_text(TEXTS[0])
    (tmp_path / "b.txt").write_text(TEXTS[1])
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": TEXTS[2], "id": 3}) + "\n\n" + json.dumps({"text": TEXTS[3]}) + "\n")
    out, val = tmp_path / "train.bin", tmp_path / "val.bin"
    assert main(["--tokenizer", str(model_dir), str(tmp_path / "a.txt"), str(tmp_path / "b.txt"),
                 str(tmp_path / "c.jsonl"), "-o", str(out), "--val-out", str(val), "--val-fraction", "0.5"]) == 0
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    eos = tok.token_to_id("<eos>")

    def ids(*docs):
        return [i for d in docs for i in tok.encode(d, add_special_tokens=False).ids + [eos]]
    assert np.fromfile(out, dtype=np.uint16).tolist() == ids(TEXTS[0], TEXTS[2])
    assert np.fromfile(val, dtype=np.uint16).tolist() == ids(TEXTS[1], TEXTS[3])
    side = json.loads(Path(f"{out}.json").read_text())  # what run --data reads beside the file
    assert side["dtype"] == "uint16" and side["eos_id"] == eos and side["documents"] == 2
    assert side["tokens"] == len(ids(TEXTS[0], TEXTS[2])) and json.loads(Path(f"{val}.json").read_text())["documents"] == 2
    printed = capsys.readouterr().out
    assert "train: 2 documents" in printed and f"--data {out} --eval-data {val}" in printed

    # a document-masked plan: its end-of-text id from the file's side (runtime.documents)
    plan = write_plan(tmp_path, "one", seq_len=16, document_mask=True)
    assert_ok(train(1, "--plan", plan, "--steps", 2, "--data", out, "--eval-data", val, "--eval-every", 2,
                    "--out", tmp_path / "run.json"))
    run = json.loads((tmp_path / "run.json").read_text())
    assert len(losses_of(tmp_path / "run.json")) == 2 and run["validation"][0]["step"] == 2


def test_a_vocabulary_beyond_uint16_writes_uint32(tmp_path, capsys):
    vocab = {f"w{i}": i for i in range(70_000)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "doc.txt").write_text("w69999 w5 w65536")
    assert main(["--tokenizer", str(tmp_path / "tokenizer.json"), str(tmp_path / "doc.txt"), "-o",
                 str(tmp_path / "t.bin"), "--eos-id", "7"]) == 0
    assert np.fromfile(tmp_path / "t.bin", dtype=np.uint32).tolist() == [69999, 5, 65536, 7]
    assert "(uint32, end-of-text id 7)" in capsys.readouterr().out
    # read as uint32 without --data-dtype: the side file says so
    assert TokenFileData(str(tmp_path / "t.bin"), seq_len=2, seed=0, vocab=70_000).tokens.dtype == np.uint32


@pytest.mark.parametrize("setup, args, message", [
    (None, ["--tokenizer", "{tmp}/none"], r"--tokenizer: .*none is not a file; give a model directory with tokenizer.json"),
    ("bad-json", [], r"c.jsonl:2: not a JSON object with a string under 'text' \(--text-key\)"),
    ("no-eos", [], r"--eos-id: .* names no end-of-text token"),
    (None, ["--eos-id", "300"], r"--eos-id: 300 is not an id of this tokenizer \(0..299\)"),
    (None, ["--val-out", "{tmp}/v.bin", "--val-fraction", "1"], r"--val-fraction: 1.0 must be at least 0 and below 1"),
    (None, ["--val-out", "{tmp}/t.bin"], r"--val-out: .*t.bin is -o's file too"),
    (None, ["--val-fraction", "0.1"], r"--val-fraction: only with --val-out"),
    (None, ["--val-out", "{tmp}/c.jsonl", "--val-fraction", "0.5"], r"--val-out: .*c.jsonl is an INPUT file"),
    ("input-out", [], r"-o: .*c.jsonl is an INPUT file, which writing it would destroy"),
    (None, ["-o", "{tmp}"], r"-o: cannot write"),
    ("latin-1", [], r"c.jsonl: not UTF-8 text"),
])
def test_bad_input_is_one_line_and_leaves_no_token_file(model_dir, tmp_path, capsys, setup, args, message):
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": TEXTS[0]}) + "\n")
    if setup == "bad-json":
        (tmp_path / "c.jsonl").write_text(json.dumps({"text": "a"}) + "\n" + json.dumps({"body": "b"}) + "\n")
    if setup == "no-eos":
        (model_dir / "tokenizer_config.json").unlink()
    if setup == "latin-1":
        (tmp_path / "c.jsonl").write_bytes(b'{"text": "caf\xe9"}\n')
    argv = ["--tokenizer", str(model_dir), str(tmp_path / "c.jsonl"), "-o", str(tmp_path / "t.bin")]
    argv += [a.format(tmp=tmp_path) for a in args]
    if setup == "input-out":  # the input named as the output: refused before it is opened, so it stays
        argv[argv.index("-o") + 1] = str(tmp_path / "c.jsonl")
    before = (tmp_path / "c.jsonl").read_bytes()
    assert main(argv) == 2
    assert (tmp_path / "c.jsonl").read_bytes() == before
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1

    assert re.search(message, err), err
    assert not (tmp_path / "t.bin").exists() and not (tmp_path / "t.bin.json").exists()
