"""Bad input to `trident plan | estimate | search | compare` (cases found by fuzzing the commands):
one line on stderr that names the field or option, a non-zero exit, never a traceback."""
import json

import pytest

from planner.cli import main
from planner.compare_cli import main as compare_main
from planner.model import ConfigError

BASE = ["--model", "tiny", "--cluster", "dgx-a100-80gb", "--gpus", "2", "--global-batch", "8", "--micro-batch", "2"]


def one_line_error(capsys, entry, argv) -> tuple[int, str]:
    """(exit status, the one stderr line) of a command that must refuse its input."""
    try:
        code = entry(argv)
    except SystemExit as exc:  # argparse
        code = exc.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0, err
    assert len(err) == 1 and "Traceback" not in err[0], err
    return code, err[0]


@pytest.mark.parametrize("extra,needle", [
    (["--tp", "0"], "argument --tp: 0 must be at least 1"),
    (["--memory-limit", "nan"], "argument --memory-limit"),
    (["--memory-limit", "-5"], "argument --memory-limit"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--global-batch", "2000000"], "training.global_batch"),
])
def test_bad_options(capsys, extra, needle):
    _, line = one_line_error(capsys, main, ["plan", *BASE, *extra])
    assert needle in line


def test_a_plan_that_does_not_fit_prints_its_estimate_then_one_line(capsys):
    code = main(["plan", "--model", "llama2-70b", "--cluster", "dgx-a100-80gb", "--gpus", "8", "--global-batch", "8",
                 "--micro-batch", "1"])
    out, err = capsys.readouterr()
    assert code == 3 and "fits" in out
    assert len(err.strip().splitlines()) == 1 and "GiB per device" in err and "--zero" in err


@pytest.fixture
def plan_file(tmp_path, capsys):
    path = tmp_path / "plan.json"
    assert main(["plan", *BASE, "--pp", "2", "--dtype", "fp32", "-o", str(path)]) == 0
    capsys.readouterr()
    return path


@pytest.mark.parametrize("edit,needle", [
    (lambda d: d["training"].update(dtype=["bf16"]), "training.dtype"),
    (lambda d: d["mesh"].update(order=["pp", 1, "tp"]), "mesh.order"),
    (lambda d: d["pipeline"].update(micro_batches=2.0), "pipeline.micro_batches: 2.0 must be a positive integer"),
    (lambda d: d["pipeline"].update(micro_batches="2"), "pipeline.micro_batches: '2' must be a positive integer"),
    (lambda d: d["cluster"].update(name=123), "cluster.name"),
    (lambda d: d["cluster"].update(profile_hash=5), "cluster.profile_hash"),
    (lambda d: d["pipeline"]["stages"][0].update(recompute=[["none"], "none"]), "pipeline.stages[0].recompute"),
    (lambda d: d["training"].update(seed=-1), "training.seed: -1 must be a non-negative integer"),
    (lambda d: d["training"].update(seed=2**64), "training.seed: 18446744073709551616 must be a non-negative integer"),
    (lambda d: d["training"].update(lr=float("inf")), "training.lr: inf must be a finite non-negative number"),
])
def test_bad_plan_fields(capsys, plan_file, edit, needle):
    d = json.loads(plan_file.read_text())
    edit(d)
    plan_file.write_text(json.dumps(d))
    _, line = one_line_error(capsys, main, ["estimate", str(plan_file)])
    assert needle in line


def test_unreadable_files_and_paths(capsys, plan_file, tmp_path):
    binary = tmp_path / "binary.json"
    binary.write_bytes(b'{"a": "\xff\xfe"}')
    assert "not a text" in one_line_error(capsys, main, ["estimate", str(binary)])[1]
    assert "-o/--output" in one_line_error(capsys, main, ["plan", *BASE, "-o", str(tmp_path)])[1]
    assert "-o/--output" in one_line_error(capsys, main, ["plan", *BASE, "-o", str(tmp_path / "no" / "p.json")])[1]


RUN = {"losses": [6.0, 5.9, 5.8], "step_times_s": [0.2, 0.1, 0.1], "warmup_steps": 1, "peak_memory_bytes": 1e6,
       "peak_memory_bytes_per_rank": [1e6, 1e6], "world_size": 2}


@pytest.mark.parametrize("edit,needle", [
    (lambda r: r.update(warmup_steps="1"), "run.warmup_steps"),
    (lambda r: r.update(step_times_s=["0.1"] * 3), "run.step_times_s"),
    (lambda r: r.update(step_times_s=[0.0] * 3), "run.step_times_s"),
    (lambda r: r.update(losses=5), "run.losses"),
    (lambda r: r.update(peak_memory_bytes_per_rank=[1e6] * 8), "run.peak_memory_bytes_per_rank: 8 entries"),
    (lambda r: r.update(world_size="2"), "run.world_size"),
])
def test_bad_run_records(capsys, plan_file, tmp_path, edit, needle):
    run = json.loads(json.dumps(RUN))
    edit(run)
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run))
    _, line = one_line_error(capsys, compare_main, [str(plan_file), str(path)])
    assert needle in line


def test_compare_checks_the_prediction_and_the_picture_path(capsys, plan_file, tmp_path):
    run = tmp_path / "run.json"
    run.write_text(json.dumps(RUN))
    assert compare_main([str(plan_file), str(run)]) == 0  # the record itself is fine
    capsys.readouterr()
    assert "--plot" in one_line_error(capsys, compare_main, [str(plan_file), str(run), "--plot", str(tmp_path / "x.xyz")])[1]
    assert "--plot" in one_line_error(capsys, compare_main,
                                      [str(plan_file), str(run), "--plot", str(tmp_path / "no" / "x.png")])[1]
    d = json.loads(plan_file.read_text())
    d["prediction"] = {}
    plan_file.write_text(json.dumps(d))
    assert "prediction.step_time_s" in one_line_error(capsys, compare_main, [str(plan_file), str(run)])[1]


def test_a_huge_global_batch_is_searched_within_the_micro_batch_cap(capsys):
    """10^8 sequences used to make the search play millions of micro-batches per configuration."""
    assert main(["search", "--model", "tiny", "--cluster", "dgx-a100-80gb", "--gpus", "4",
                 "--global-batch", "100000000", "--top", "1", "--json"]) == 0
    best = json.loads(capsys.readouterr().out)
    assert best["fits"]


def test_a_plan_with_more_ranks_than_this_machines_gpus_is_refused_in_one_line(monkeypatch):
    """With GPUs present, each rank needs its own (two ranks on one GPU would fail inside NCCL);
    without any, the plan runs on the CPU."""
    import torch

    from runtime import device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    msg = device.gpus_short(8)
    assert "8 ranks per node need a GPU each and this machine has 4" in msg and "--gpus 4" in msg
    assert device.gpus_short(4) is None
    with pytest.raises(ConfigError, match="5 ranks per node need a GPU each"):
        device.init(4)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert device.gpus_short(8) is None
    assert device.init(4) == ("gloo", torch.device("cpu"))
