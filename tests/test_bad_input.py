"""Bad input to `trident plan | estimate | search | compare` (cases found by fuzzing the commands):
one line on stderr that names the field or option, a non-zero exit, never a traceback."""
import json
import re

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
    (["--seq-len", str(10**19)], "argument --seq-len: 10000000000000000000 is out of range"),
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
    (lambda d: d["training"].update(seed=2**64), "training.seed: an integer of 20 digits is out of range"),
    (lambda d: d["model"].update(norm_eps=10**400), "model.norm_eps: an integer of 401 digits is out of range"),
    (lambda d: d["model"].update(name="\ud800"), "model.name: '\\ud800' is not Unicode text"),
    (lambda d: d["training"].update({"\udc00": 1}), "training: the key '\\udc00' is not Unicode text"),
    (lambda d: d.pop("format_version"), "format_version: missing"),
    (lambda d: d["training"].update(lr=float("inf")), "training.lr: inf is not a finite number"),
    # found by fuzzing: lr 1e300 overflowed float32 inside AdamW's update (a traceback), 1e30 and
    # weight decay 1e300 trained to NaN losses with exit 0
    (lambda d: d["training"].update(lr=1e300), "training.lr: 1e+300 must be at most 10"),
    (lambda d: d["training"].update(weight_decay=1e300), "training.weight_decay: 1e+300 times training.lr"),
    (lambda d: d["training"].update(lr=2.0, weight_decay=0.5), "must be below 1"),
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
    run = tmp_path / "run.json"
    run.write_text(json.dumps(RUN))
    for text, words in (("", "Expecting value"), ("[" * 100000 + "]" * 100000, "nested too deeply"),
                        ('{"a": ' + "9" * 5000 + "}", "an integer of over 4300 digits")):
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        for argv in (["estimate", str(bad)], ["cluster", "show", str(bad)], ["plan", *BASE, "--cluster", str(bad)]):
            assert words in one_line_error(capsys, main, argv)[1]
        for argv in ([str(bad), str(run)], [str(plan_file), str(bad)]):
            assert words in one_line_error(capsys, compare_main, argv)[1]
    assert "-o/--output" in one_line_error(capsys, main, ["plan", *BASE, "-o", str(tmp_path)])[1]
    assert "-o/--output" in one_line_error(capsys, main, ["plan", *BASE, "-o", str(tmp_path / "no" / "p.json")])[1]


RUN = {"losses": [6.0, 5.9, 5.8], "step_times_s": [0.2, 0.1, 0.1], "warmup_steps": 1, "peak_memory_bytes": 1e6,
       "peak_memory_bytes_per_rank": [1e6, 1e6], "world_size": 2}


@pytest.mark.parametrize("edit,needle", [
    (lambda r: r.update(warmup_steps="1"), "run.warmup_steps"),
    (lambda r: r.update(step_times_s=["0.1"] * 3), "run.step_times_s"),
    (lambda r: r.update(step_times_s=[0.0] * 3), "run.step_times_s"),
    (lambda r: r.update(step_times_s=[1e308] * 3), "run.step_times_s"),
    (lambda r: r.update(losses=5), "run.losses"),
    (lambda r: r.update(peak_memory_bytes_per_rank=[1e6] * 8), "run.peak_memory_bytes_per_rank: 8 entries"),
    (lambda r: r.update(world_size="2"), "run.world_size"),
    (lambda r: r.update(note="\ud800"), "note: '\\ud800' is not Unicode text"),
    (lambda r: r.update(optimizer_times_s=["0.1"] * 3), "run.optimizer_times_s"),
    (lambda r: r.update(optimizer_times_s=[None] * 3), "run.optimizer_times_s"),
    (lambda r: r.update(peak_memory_bytes=-0.5), "run.peak_memory_bytes"),
    (lambda r: r.update(peak_memory_bytes_per_rank=[-0.5, 1e6]), "run.peak_memory_bytes_per_rank"),
    (lambda r: r.update(step_times_s=[5e-324] * 3), "run.step_times_s"),  # tokens/s would be inf
    (lambda r: r.update(optimizer_times_s=[1.0] * 3), "run.optimizer_times_s"),  # longer than the steps
    (lambda r: r.update(dtype="a\nb"), "run.dtype"),  # printed raw, a second line
    (lambda r: r.update(dtype=["bf16"]), "run.dtype"),
    (lambda r: r.update(host_other_busy_cores=5, host_cores=2), "run.host_other_busy_cores"),
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
    for value in (None, 5, "x", [1e6, "x"]):
        d["prediction"]["breakdown"]["memory_per_pp_rank"] = value
        plan_file.write_text(json.dumps(d))
        if value is None:
            assert compare_main([str(plan_file), str(run)]) == 0
            capsys.readouterr()
        else:
            assert "prediction.breakdown.memory_per_pp_rank" in one_line_error(
                capsys, compare_main, [str(plan_file), str(run)])[1]
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


def test_search_without_a_fit_empty_paths_and_derive_onto_shipped_profiles(capsys, tmp_path):
    """One `trident: error:` line each: a search where nothing fits; an empty -o, --plot, --cluster;
    `cluster derive` onto its base or another shipped profile, or at a NIC rate out of range."""
    from planner.cluster import PROFILE_DIR
    code, line = one_line_error(capsys, main, ["search", "--model", "llama2-70b", "--cluster", "dgx-a100-80gb",
                                                "--gpus", "8", "--global-batch", "8"])
    assert code == 3 and line.startswith("trident: error: no plan of llama2-70b fits")
    for argv in (["search", *BASE, "-o", ""], ["plan", *BASE, "--plot", " "], ["plan", *BASE[:2], "--cluster", "",
                                                                                 *BASE[4:]]):
        assert "an empty value" in one_line_error(capsys, main, argv)[1]
    for target in ("dgx-a100-80gb", "dgx-h100-80gb"):
        before = (PROFILE_DIR / f"{target}.json").read_bytes()
        line = one_line_error(capsys, main, ["cluster", "derive", "dgx-a100-80gb", "--nic-gbps", "100",
                                             "-o", str(PROFILE_DIR / f"{target}.json")])[1]
        assert ("is the base profile" if target == "dgx-a100-80gb" else "is a shipped profile") in line
        assert (PROFILE_DIR / f"{target}.json").read_bytes() == before
    assert "--nic-gbps: 1e-300 must be a finite number from" in one_line_error(
        capsys, main, ["cluster", "derive", "dgx-a100-80gb", "--nic-gbps", "1e-300", "-o", str(tmp_path / "x.json")])[1]


def test_a_profile_too_slow_to_price_is_one_line(capsys, tmp_path):
    """Finite figures whose step overflows (1e-300 B/s of memory bandwidth at 1e-20 of it achieved):
    refused, not priced at inf or nan."""
    from planner.cluster import PROFILE_DIR
    d = json.loads((PROFILE_DIR / "dgx-a100-80gb.json").read_text())
    path = tmp_path / "slow.json"
    plan = ["plan", "--model", "tiny", "--cluster", str(path), "--gpus", "16", "--global-batch", "16",
            "--micro-batch", "1", "--tp", "2", "--pp", "2"]
    d["device"].update(memory_bandwidth_bytes_per_s=1e-300)  # no figure of a byte rate: refused as read
    path.write_text(json.dumps(d))
    assert "device.memory_bandwidth_bytes_per_s: 1e-300 must be from 1000" in one_line_error(capsys, main, plan)[1]
    # each figure in range, the step beyond planner.cost.MAX_STEP_S (tiny's step at 1e-17 B/s)
    d["device"].update(memory_bandwidth_bytes_per_s=1e3, memory_bandwidth_efficiency=1e-20)
    path.write_text(json.dumps(d))
    assert "is too small to compute with" in one_line_error(capsys, main, plan)[1]
    d["device"].update(memory_bandwidth_efficiency=0.8, reserved_bytes=d["device"]["memory_bytes"])
    path.write_text(json.dumps(d))
    assert "device.reserved_bytes" in one_line_error(capsys, main, plan)[1]


def test_unwritable_pictures_odd_files_and_limits_out_of_range(capsys, plan_file, tmp_path):
    """Found by fuzzing: --plot onto a directory (a traceback from matplotlib), a FIFO or a device
    as an input file (a read that blocks or never ends), --memory-limit 1e300 (inf bytes, which the
    plan file then refused), a prediction's optimizer term that is not a number (a traceback)."""
    import os
    (tmp_path / "dir.png").mkdir()
    for argv in (["estimate", str(plan_file)], ["search", *BASE, "--top", "1"]):
        assert "--plot: cannot write" in one_line_error(capsys, main, [*argv, "--plot", str(tmp_path / "dir.png")])[1]
    assert "argument --memory-limit" in one_line_error(capsys, main, ["plan", *BASE, "--memory-limit", "1e300"])[1]
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    run = tmp_path / "run.json"
    run.write_text(json.dumps(RUN))
    for entry, argv in ((main, ["estimate", str(fifo)]), (main, ["cluster", "show", str(fifo)]),
                        (main, ["plan", *BASE[2:], "--model", str(fifo)]), (main, ["estimate", "/dev/zero"]),
                        (compare_main, [str(plan_file), str(fifo)])):
        assert "is not a regular file" in one_line_error(capsys, entry, argv)[1]
    d = json.loads(plan_file.read_text())
    d["prediction"]["breakdown"]["time"]["optimizer_s"] = None
    d["prediction"]["breakdown"].pop("optimizer_per_pp_rank_s", None)
    plan_file.write_text(json.dumps(d))
    run.write_text(json.dumps({**RUN, "optimizer_times_s": [0.01] * 3}))
    assert "prediction.breakdown.time.optimizer_s" in one_line_error(capsys, compare_main, [str(plan_file), str(run)])[1]


def test_profile_names_are_one_printable_line(capsys, tmp_path):
    """A newline in a profile's name would print a second (forgeable) `trident: error:` line in
    every message that names the profile: refused when read, and as --name when written."""
    from planner.cluster import PROFILE_DIR
    d = json.loads((PROFILE_DIR / "dgx-a100-80gb.json").read_text())
    d["name"] = "a100\ntrident: error: forged"
    path = tmp_path / "nl.json"
    path.write_text(json.dumps(d))
    assert "name must be a non-empty printable string of one line" in one_line_error(
        capsys, main, ["cluster", "show", str(path)])[1]
    assert "argument --name" in one_line_error(capsys, main, ["cluster", "derive", "dgx-a100-80gb", "--nic-gbps", "100",
                                                              "--name", "a\nb", "-o", str(tmp_path / "x.json")])[1]
    # a model's name (from its JSON, or from a file name that is no printable line: "model") and a plan's cluster
    model = {"name": "m\ntrident: error: forged", "arch": "llama", "layers": 2, "hidden": 64, "ffn_hidden": 128,
             "heads": 4, "kv_heads": 4, "vocab": 256, "seq_len": 32, "tie_embeddings": False}
    (tmp_path / "m.json").write_text(json.dumps(model))
    plan = ["plan", "--cluster", "dgx-a100-80gb", "--gpus", "1", "--global-batch", "2", "--micro-batch", "1"]
    assert "model.name: is 'm\\ntrident" in one_line_error(capsys, main, [*plan, "--model", str(tmp_path / "m.json")])[1]
    del model["name"]
    (tmp_path / "m\nx.json").write_text(json.dumps(model))
    assert main([*plan, "--model", str(tmp_path / "m\nx.json"), "-o", str(tmp_path / "p.json")]) == 0
    d = json.loads((tmp_path / "p.json").read_text())
    assert d["model"]["name"] == "model"
    d["cluster"]["name"] = "a\nb"
    (tmp_path / "p.json").write_text(json.dumps(d))
    assert "cluster.name: 'a\\nb' must be" in one_line_error(capsys, main, ["estimate", str(tmp_path / "p.json")])[1]


def _train_patched(tmp_path, patch: str, steps: int) -> tuple[int, list]:
    """runtime.train on one process with `patch` (Python run first) applied: exit status and its
    `trident: error` lines."""
    import os
    import subprocess
    import sys
    from tests.torchrun_helpers import REPO, write_plan
    code = f"import sys, pathlib, runtime.train as t; {patch}; sys.exit(t.main(sys.argv[1:]))"
    argv = ["--plan", str(write_plan(tmp_path, "p")), "--steps", str(steps), "--out", str(tmp_path / "r.json")]
    proc = subprocess.run([sys.executable, "-c", code, *argv], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    return proc.returncode, [line for line in proc.stderr.splitlines() if line.startswith("trident: error")]


def test_a_diverged_run_stops_in_one_line_naming_the_step(tmp_path):
    """A loss that is not finite (an overflow in low precision, a rate too high) stops the run at
    that step with exit 2 and one line, not a record of NaN losses with exit 0."""
    code, err = _train_patched(tmp_path, "real = t.Trainer.step; t.Trainer.step = lambda self, batch, step: "
                                         "float('nan') if step == 1 else real(self, batch, step)", 3)
    assert code == 2 and len(err) == 1, err
    assert re.search(r"step 2: the loss is nan \(gradient norm [0-9.]+\): training diverged; lower training.lr", err[0])
    assert not (tmp_path / "r.json").exists()


def test_a_record_that_cannot_be_written_after_the_run_is_one_line(tmp_path):
    """A disk that fills during the run: the record's write fails after training, in one line."""
    code, err = _train_patched(tmp_path, "pathlib.Path.write_text = lambda *a, **k: (_ for _ in ()).throw("
                                         "OSError(28, 'No space left on device'))", 1)
    assert code == 2 and len(err) == 1 and "--out: cannot write" in err[0] and "No space left" in err[0], err


def test_a_profile_output_that_cannot_be_written_is_refused_before_profiling(capsys, tmp_path):
    """Found by trying it: `trident profile cluster -o /proc/x.json` profiled, then ended in a
    traceback; a device or a directory in the file's place are refused too."""
    from runtime.profile import launch
    for out, says in (("/proc/x.json", "--out: cannot write under /proc"),
                      ("/dev/null", "--out: /dev/null is not a regular file"),
                      (str(tmp_path), f"--out: {tmp_path} is a directory")):
        for what in (["cluster"], ["model", "--model", "tiny", "--cluster-profile", "x", "--seq-len", "32"]):
            assert launch([*what, "-o", out, "--nproc-per-node", "2"]) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and says in err[0], err


def test_an_odd_sequence_is_profiled_without_context_parallelism():
    """`trident profile model --seq-len 33` was refused as if measuring CP 1 split the sequence
    into two chunks; only CP above 1 does (2 x cp chunks a sequence)."""
    from runtime.profile import parse_args
    from runtime.profile_model import check_args
    base = ["model", "--model", "tiny", "--cluster-profile", "dgx-a100-80gb", "--seq-len", "33", "-o", "m.json"]
    check_args(parse_args(base), 2)
    with pytest.raises(ConfigError, match=r"--cp: 2 must divide the 2 processes launched and its double the sequence"):
        check_args(parse_args([*base, "--cp", "1,2"]), 2)


def test_the_metrics_log_and_checkpoint_retention_are_checked_before_training(tmp_path, capsys):
    """--metrics and --keep-checkpoints: a place no file can be, a retention without checkpoints or
    below 0, one log for several plans, each one line before any process group."""
    from runtime.train import main as train_main
    from tests.torchrun_helpers import write_plan
    plan, other = str(write_plan(tmp_path, "p")), str(write_plan(tmp_path, "q"))
    for argv, says in ((["--metrics", str(tmp_path)], f"--metrics: {tmp_path} is a directory"),
                       (["--keep-checkpoints", "2"], "--keep-checkpoints needs --checkpoint-dir"),
                       (["--keep-checkpoints", "-1", "--checkpoint-dir", str(tmp_path / "c")],
                        "--keep-checkpoints: -1 must be at least 0"),
                       (["--steps", "2", "--checkpoint-every", "5", "--checkpoint-dir", str(tmp_path / "c")],
                        "--checkpoint-every: 5 is more than --steps 2, so no checkpoint would be written"),
                       (["--metrics", str(tmp_path / "m.jsonl"), "--plan", plan, other],
                        "--metrics works with one --plan at a time")):
        assert train_main(["--plan", plan, *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], (argv, err)


def test_trident_run_checks_the_checkpoint_directory_before_launching(tmp_path, capsys):
    """A directory holding a checkpoint without --resume, a corrupt one, and one at --steps already:
    one line before torchrun starts (inside the ranks each printed a second, the launcher's)."""
    from planner.cli import main
    from planner.plan import Plan
    from runtime import checkpoint
    from tests.torchrun_helpers import write_plan
    plan = write_plan(tmp_path, "p")
    p = Plan.read(plan)
    (tmp_path / "ck" / "step-2").mkdir(parents=True)
    meta = {"plan_hash": p.content_hash(), "layout": checkpoint.BY_NAME, "run": checkpoint.run_of(p), "step": 2,
            "data": {"next_step": 2}}
    (tmp_path / "ck" / "step-2" / checkpoint.META).write_text(json.dumps(meta))
    run = ["run", str(plan), "--checkpoint-dir", str(tmp_path / "ck"), "--steps", "2"]
    for extra, says in (([], "--checkpoint-dir: .* already holds step-2; pass --resume"),
                        (["--resume"], "--steps: 2, but .*step-2 already reached step 2; ask for more steps")):
        code, line = one_line_error(capsys, main, run + extra)
        assert code == 2 and re.search(says, line), line
    meta["data"]["next_step"] = -1
    (tmp_path / "ck" / "step-2" / checkpoint.META).write_text(json.dumps(meta))
    code, line = one_line_error(capsys, main, run[:-1] + ["5", "--resume"])
    assert code == 2 and "unreadable or corrupt" in line, line
