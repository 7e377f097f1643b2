"""`trident search` over several cluster sizes: each size's best plan is the one a search of that
size alone finds, -o writes one plan a size, and what cannot work is refused in one line."""
import json

import pytest

from planner.cli import main
from planner.plan import Plan

LLAMA = ["search", "--model", "llama2-7b", "--cluster", "dgx-a100-80gb", "--global-batch", "64", "--seq-len", "4096"]


def test_each_size_gets_the_plan_its_own_search_finds(tmp_path, capsys):
    out = tmp_path / "plan-{gpus}.json"
    assert main([*LLAMA, "--gpus", "16,1,8", "--json", "-o", str(out)]) == 0
    sizes = json.loads(capsys.readouterr().out)["sizes"]
    assert [s["gpus"] for s in sizes] == [1, 8, 16] and [s["nodes"] for s in sizes] == [1, 1, 2]
    assert sizes[0]["fits"] is False and sizes[0]["estimate"] is None and sizes[0]["min_required_bytes"] > 80 * 2**30
    assert not (tmp_path / "plan-1.json").exists()
    for s in sizes[1:]:
        assert s["fits"]
        assert main([*LLAMA, "--gpus", str(s["gpus"]), "--json"]) == 0
        alone = json.loads(capsys.readouterr().out)
        assert s["estimate"]["step_time_s"] == pytest.approx(alone["step_time_s"], rel=1e-12)
        written = Plan.read(str(tmp_path / f"plan-{s['gpus']}.json"))
        assert written.mesh.world_size == s["gpus"]
        assert written.mesh.tp == s["degrees"]["tp"] and written.mesh.pp == s["degrees"]["pp"]
        assert written.prediction["step_time_s"] == s["estimate"]["step_time_s"]
    # twice the GPUs, at least a little faster, and none of the ranks over the device's memory
    assert sizes[2]["estimate"]["step_time_s"] < sizes[1]["estimate"]["step_time_s"]


def test_the_table_shows_scaling_against_the_first_size_that_fits(capsys):
    assert main([*LLAMA, "--nodes", "1,2,4", "--json"]) == 0
    sizes = json.loads(capsys.readouterr().out)["sizes"]
    assert main([*LLAMA, "--nodes", "1,2,4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[:5] == ["GPUs", "nodes", "tp", "pp", "dp"] and "per GPU vs first" in lines[1]
    first = sizes[0]["estimate"]["tokens_per_s"] / sizes[0]["gpus"]
    for line, s in zip(lines[2:], sizes):
        est = s["estimate"]
        assert line.split()[:2] == [str(s["gpus"]), str(s["nodes"])]
        ratio = est["tokens_per_s"] / s["gpus"] / first
        gpu_hours = s["gpus"] * 1e9 / est["tokens_per_s"] / 3600
        days = 1e12 / est["tokens_per_s"] / 86400
        assert s["per_gpu_vs_first"] == pytest.approx(ratio) and s["gpu_hours_per_billion_tokens"] == pytest.approx(gpu_hours)
        assert s["days_per_trillion_tokens"] == pytest.approx(days)
        for shown in (f"{est['step_time_s']:.4g}", f"{est['tokens_per_s']:,.0f}", f"{ratio:.2f}", f"{est['mfu']:.1%}",
                      f"{gpu_hours:,.1f}", f"{days:,.1f}"):
            assert f" {shown} " in f" {line} ", (shown, line)
    assert f"{1.0:.2f}" in lines[2]


@pytest.mark.parametrize("extra,field", [(["-o", "plan.json"], "-o"), (["--plot", "sizes.txt"], "--plot")])
def test_what_several_sizes_cannot_do_is_one_line(extra, field, capsys):
    assert main([*LLAMA, "--gpus", "8,16", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"trident: error: {field}:")


def test_the_sizes_are_drawn(tmp_path, capsys):
    picture = tmp_path / "sizes.png"
    assert main([*LLAMA, "--gpus", "1,8,16", "--plot", str(picture)]) == 0
    assert picture.stat().st_size > 10_000 and f"wrote {picture}" in capsys.readouterr().out


def test_no_size_fits_is_one_line_and_exit_3(capsys):
    assert main(["search", "--model", "llama2-70b", "--cluster", "dgx-a100-80gb", "--gpus", "1,2",
                 "--global-batch", "8"]) == 3
    cap = capsys.readouterr()
    assert cap.out.count("no fit") == 2
    err = cap.err.strip().splitlines()
    assert len(err) == 1 and "fits at any of these sizes" in err[0] and "add larger sizes" in err[0]


def test_a_size_the_constraints_rule_out_is_excluded_and_the_others_stand(capsys):
    assert main([*LLAMA, "--gpus", "8,16", "--dp", "16", "--json"]) == 0
    eight, sixteen = json.loads(capsys.readouterr().out)["sizes"]
    assert eight["fits"] is False and eight["error"].startswith("--dp: 16 admits no configuration")
    assert sixteen["fits"] and sixteen["degrees"]["tp"] * sixteen["degrees"]["pp"] == 1
    assert main([*LLAMA, "--gpus", "8,16", "--dp", "16"]) == 0
    out = capsys.readouterr().out
    assert "excluded" in out.splitlines()[2] and "excluded, 8 GPUs: --dp: 16" in out
    # ruled out at every size: one line, exit 2
    assert main([*LLAMA, "--gpus", "8,16", "--dp", "64"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no size admits a configuration" in err[0] and "--dp: 64" in err[0]
