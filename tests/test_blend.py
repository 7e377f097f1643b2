"""Blended data (runtime.blend): weighted token files, interleaved evenly, each read in epochs of
its own; the batch of a step depends on the seed and the step alone."""
from __future__ import annotations

import json

import numpy as np
import pytest

from planner.model import ConfigError
from runtime.blend import PERIOD, BlendedData, parse_blend, places
from runtime.data import make_source, source_meta
from torchrun_helpers import assert_ok, train, write_plan

S = 16


def _file(path, n_windows: int, first: int, eos=None):
    """Windows whose first token says the file (`first` + window): token t of window w is
    first + w, then w's position."""
    ids = np.concatenate([[first + w] + list(range(1, S)) for w in range(n_windows)] + [[0]]).astype(np.uint16)
    ids.tofile(path)
    if eos is not None:
        path.with_name(path.name + ".json").write_text(json.dumps({"dtype": "uint16", "eos_id": eos}))
    return str(path)


def test_files_take_their_shares_evenly_and_read_every_window_once_an_epoch(tmp_path):
    a, b, c = _file(tmp_path / "a.bin", 30, 1000), _file(tmp_path / "b.bin", 20, 2000), _file(tmp_path / "c.bin", 7, 3000)
    blend = make_source(f"{a}:5,{b}:3,{c}:2", S, 0, 2**16)
    assert isinstance(blend, BlendedData) and list(blend.places) == [5000, 3000, 2000]
    rows = np.concatenate([blend.batch(i, 10).numpy() for i in range(60)])  # 600 samples
    which = rows[:, 0] // 1000 - 1
    for lo in range(0, 600, 100):  # any 100 consecutive samples: the shares, within one
        assert np.abs(np.bincount(which[lo:lo + 100], minlength=3) - [50, 30, 20]).max() <= 1
    for d, n in enumerate((30, 20, 7)):  # each file's samples, in order: its epochs, every window once
        windows = rows[which == d, 0] % 1000
        for e in range(len(windows) // n):
            assert sorted(windows[e * n:(e + 1) * n].tolist()) == list(range(n)), (d, e)
    assert [e["epochs"] for e in blend.epochs(600)] == pytest.approx([300 / 30, 180 / 20, 120 / 7])
    assert [(e["file"], e["share"]) for e in blend.epochs(600)] == [(a, 0.5), (b, 0.3), (c, 0.2)]
    again = make_source(f"{a}:5,{b}:3,{c}:2", S, 0, 2**16)
    assert (again.batch(37, 10).numpy() == rows[370:380]).all()  # the step alone says its batch
    assert not (make_source(f"{a}:5,{b}:3,{c}:2", S, 1, 2**16).batch(0, 10).numpy() == rows[:10]).all()
    assert "a.bin: 481 tokens, 30 windows of 17" in blend.describe(10) and "(50.00% of the samples)" in blend.describe(10)


def test_the_places_add_up_to_the_period():
    assert places([1, 1, 1]).tolist() == [3334, 3333, 3333] and places([0.7, 0.3]).tolist() == [7000, 3000]
    assert places([1e-9, 1]).sum() == PERIOD


@pytest.mark.parametrize("spec, message", [
    ("{a}:0.5,{b}", r"'.*b.bin' gives no weight; blend files as FILE:WEIGHT"),
    ("{a}:0,{b}:1", r"the weight of .*a.bin is 0; give a positive number"),
    ("{a}:-1,{b}:1", r"the weight of .*a.bin is -1"),
    ("{a}:1e-6,{b}:1", r"the weight of .*a.bin \(1e-06\) is below 1/10000 of the total"),
    ("{a}:1,{tmp}/none.bin:1", r"none.bin is not a file"),
    ("{a}:1e308,{b}:1e308", r"the weights sum past the largest float"),  # inf, then NaN shares
    ("{a}:1,{tmp}/odd.bin:1", r"odd.bin holds 1001 bytes, not a whole number of uint16 tokens"),
])
def test_a_bad_blend_is_one_line_naming_the_file(tmp_path, spec, message):
    a, b = _file(tmp_path / "a.bin", 4, 1000), _file(tmp_path / "b.bin", 4, 2000)
    (tmp_path / "odd.bin").write_bytes(bytes(1001))  # a truncated uint16 file
    with pytest.raises(ConfigError, match=message):
        make_source(spec.format(a=a, b=b, tmp=tmp_path), S, 0, 2**16)


def test_a_blend_shares_its_files_end_of_text_id_and_trains(tmp_path):
    a, b = _file(tmp_path / "a.bin", 40, 100, eos=7), _file(tmp_path / "b.bin", 40, 200, eos=7)
    assert parse_blend(a) is None and source_meta(f"{a}:1,{b}:1") == {"eos_id": 7}
    c = _file(tmp_path / "c.bin", 40, 300, eos=8)
    with pytest.raises(ConfigError, match=r"end their documents with different ids"):
        source_meta(f"{a}:1,{c}:1")
    plan = write_plan(tmp_path, "masked", seq_len=S, document_mask=True)  # the blend's end-of-text id
    held = _file(tmp_path / "held.bin", 10, 400, eos=7)
    proc = train(1, "--plan", plan, "--steps", 2, "--data", f"{a}:0.75,{b}:0.25", "--out", tmp_path / "r.json",
                 "--eval-data", f"{held}:1,{b}:1", "--eval-every", 2)  # a blend validates too
    assert_ok(proc)
    assert "(75.00% of the samples)" in proc.stdout and "validation loss" in proc.stdout
    epochs = json.loads((tmp_path / "r.json").read_text())["data_epochs"]
    assert [(e["file"], e["share"]) for e in epochs] == [(a, 0.75), (b, 0.25)]
    assert [e["epochs"] for e in epochs] == pytest.approx([12 / 40, 4 / 40])
