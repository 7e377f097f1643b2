"""The `trident` command: plan and estimate agree, bad input is one line and a non-zero exit."""
import json
import subprocess
import sys

import pytest

from planner.cli import main


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "planner.cli", *args], capture_output=True, text=True, timeout=60)


def test_plan_writes_a_file_that_estimate_reproduces(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = main(["plan", "--model", "llama2-7b", "--cluster", "dgx-a100-80gb", "--gpus", "16", "--global-batch", "32",
               "--micro-batch", "2", "--tp", "4", "--pp", "2", "--schedule", "interleaved-1f1b",
               "--virtual-stages", "2", "--zero", "1", "--seq-len", "2048", "-o", str(out), "--json"])
    assert rc == 0
    planned = json.loads(capsys.readouterr().out)
    assert main(["estimate", str(out), "--json"]) == 0
    estimated = json.loads(capsys.readouterr().out)
    assert planned == estimated
    assert planned["parameters"] == 6738415616
    assert planned["fits"] is True
    assert planned["step_time_s"] > 0 and planned["tokens_per_s"] == pytest.approx(32 * 2048 / planned["step_time_s"])


def test_estimate_on_another_cluster_says_which_it_priced(tmp_path, capsys):
    """`estimate --cluster` prices a plan on another profile: the header names the device priced
    and a note the plan's own; the plan's own profile prices it without a note."""
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "tiny", "--cluster", "dgx-a100-80gb", "--gpus", "2", "--global-batch", "4",
                 "--micro-batch", "1", "--pp", "2", "-o", str(out)]) == 0
    capsys.readouterr()
    assert main(["estimate", str(out)]) == 0
    own = capsys.readouterr()
    assert "A100" in own.out.splitlines()[0] and own.err == ""
    assert main(["estimate", str(out), "--cluster", "dgx-h100-80gb"]) == 0
    other = capsys.readouterr()
    assert "NVIDIA H100" in other.out.splitlines()[0] and "(dgx-h100-80gb)" in other.out.splitlines()[0]
    assert other.err.strip() == ("note: priced on dgx-h100-80gb (NVIDIA H100-SXM5-80GB), not the plan's "
                                 "dgx-a100-80gb (NVIDIA A100-SXM4-80GB)")


def test_human_table(capsys):
    assert main(["plan", "--model", "tiny", "--cluster", "dgx-h100-80gb", "--gpus", "2", "--global-batch", "4",
                 "--micro-batch", "1", "--pp", "2", "--schedule", "gpipe"]) == 0
    text = capsys.readouterr().out
    assert "pipeline bubble" in text and "peak memory per GPU" in text


def test_schedule_with_pp1_is_accepted(capsys):
    assert main(["plan", "--model", "tiny", "--cluster", "hgx-h200-141gb", "--gpus", "2", "--global-batch", "4",
                 "--micro-batch", "1", "--schedule", "interleaved-1f1b", "--virtual-stages", "2", "--json"]) == 0


@pytest.mark.parametrize("args,needle", [
    (["--tp", "3"], "mesh"),
    (["--tp", "8"], "mesh.tp: 8 does not divide model.kv_heads"),
    (["--tp", "2", "--pp", "2", "--dp", "4"], "mesh"),
    (["--global-batch", "7"], "training.global_batch"),
    (["--model", "nope"], "--model"),
    (["--cluster", "nope"], "--cluster"),
])
def test_bad_input_is_one_clear_line(args, needle):
    base = {"--model": "tiny", "--cluster": "dgx-a100-80gb", "--gpus": "8", "--global-batch": "8", "--micro-batch": "1"}
    for i in range(0, len(args), 2):
        base[args[i]] = args[i + 1]
    flat = [x for kv in base.items() for x in kv]
    proc = run_cli("plan", *flat)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in proc.stderr


def test_estimate_of_a_malformed_plan(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"format_version": 1}')
    proc = run_cli("estimate", str(bad))
    assert proc.returncode == 2 and "plan.model: missing" in proc.stderr
    proc = run_cli("estimate", str(tmp_path / "absent.json"))
    assert proc.returncode == 2 and "cannot read" in proc.stderr


def test_execution_flags_reach_the_plan_and_the_estimate(tmp_path, capsys):
    base = ["plan", "--model", "llama2-7b", "--cluster", "dgx-a100-80gb", "--gpus", "16", "--global-batch", "32",
            "--micro-batch", "1", "--tp", "4", "--pp", "2", "--seq-len", "2048", "--json"]
    assert main(base) == 0
    default = json.loads(capsys.readouterr().out)
    out = tmp_path / "plan.json"
    assert main(base + ["--no-overlap-grad-reduce", "--no-overlap-param-gather", "--lockstep", "--sent-outputs", "freed",
                        "-o", str(out)]) == 0
    deepspeed_like = json.loads(capsys.readouterr().out)
    written = json.loads(out.read_text())
    assert written["training"]["overlap_grad_reduce"] is False and written["pipeline"]["lockstep"] is True
    assert written["training"]["overlap_param_gather"] is False
    assert written["pipeline"]["sent_outputs"] == "freed"
    assert deepspeed_like["peak_memory_bytes"] < default["peak_memory_bytes"]
    assert main(base + ["--recv-buffers", "preallocated"]) == 0  # torch.distributed.pipelining's own buffers
    assert json.loads(capsys.readouterr().out)["peak_memory_bytes"] > default["peak_memory_bytes"]
    assert deepspeed_like["step_time_s"] >= default["step_time_s"]
    assert main(base + ["--p2p", "scatter-gather", "--async-tp-allreduce", "--grad-accumulation", "fused",
                        "-o", str(out)]) == 0
    megatron_like = json.loads(capsys.readouterr().out)
    written = json.loads(out.read_text())
    assert written["pipeline"]["p2p"] == "scatter-gather" and written["training"]["async_tp_allreduce"] is True
    assert written["training"]["grad_accumulation"] == "fused"
    assert megatron_like["step_time_s"] < default["step_time_s"]
    assert main(["estimate", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == megatron_like
    assert main(base + ["--elementwise-kernels", "fused", "--no-fsdp-copies", "--attention", "unfused",
                        "-o", str(out)]) == 0
    fused = json.loads(capsys.readouterr().out)
    written = json.loads(out.read_text())["training"]
    assert written["elementwise_kernels"] == "fused" and written["fsdp_copies"] is False
    assert written["attention"] == "unfused"
    assert fused["breakdown"]["time"]["fsdp_copy_s"] == 0.0 < default["breakdown"]["time"]["fsdp_copy_s"]


def test_plan_estimate_and_search_draw_the_prediction(tmp_path, capsys):
    """--plot writes a picture (step terms, memory per pipeline rank, the played timeline); a path
    of another format is refused in one line before any work."""
    plan, pic = tmp_path / "plan.json", tmp_path / "plan.png"
    common = ["--model", "tiny", "--cluster", "dgx-a100-80gb", "--gpus", "4", "--global-batch", "8"]
    assert main(["plan", *common, "--micro-batch", "1", "--pp", "2", "-o", str(plan), "--plot", str(pic)]) == 0
    assert pic.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    svg = tmp_path / "estimate.svg"
    assert main(["estimate", str(plan), "--plot", str(svg)]) == 0 and b"<svg" in svg.read_bytes()[:400]
    best = tmp_path / "search.pdf"
    assert main(["search", *common, "--top", "1", "--json", "--plot", str(best)]) == 0
    assert best.read_bytes()[:4] == b"%PDF"
    capsys.readouterr()
    assert main(["search", *common, "--plot", str(tmp_path / "x.jpg")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--plot" in err[0]
