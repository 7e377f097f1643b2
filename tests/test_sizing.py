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


def test_several_clusters_side_by_side(tmp_path, capsys):
    """Each cluster and size gets the plan a search of it alone finds; a size that does not suit a
    cluster (12 GPUs of 8-GPU nodes) is excluded with its reason; -o names each cluster's plans."""
    four = tmp_path / "a100-x4.json"
    assert main(["cluster", "derive", "dgx-a100-80gb", "--devices-per-node", "4", "--nics-per-node", "1",
                 "-o", str(four)]) == 0
    both = ["--cluster", f"dgx-a100-80gb,{four}"]
    args = [a for a in LLAMA if a not in ("--cluster", "dgx-a100-80gb")]
    out = tmp_path / "plan-{cluster}-{gpus}.json"
    capsys.readouterr()
    assert main([*args, *both, "--gpus", "8,12", "--json", "-o", str(out)]) == 0
    sizes = json.loads(capsys.readouterr().out)["sizes"]
    assert [(s["cluster"], s["gpus"], s["nodes"]) for s in sizes] == [
        ("dgx-a100-80gb", 8, 1), ("dgx-a100-80gb", 12, None), ("a100-x4", 8, 2), ("a100-x4", 12, 3)]
    assert sizes[1]["error"].startswith("--gpus: 12 is not a whole number of 8-GPU nodes")
    first = sizes[0]["estimate"]["tokens_per_s"] / 8
    for s, cluster in ((sizes[0], "dgx-a100-80gb"), (sizes[2], str(four)), (sizes[3], str(four))):
        assert main([*args, "--cluster", cluster, "--gpus", str(s["gpus"]), "--json"]) == 0
        alone = json.loads(capsys.readouterr().out)
        assert s["estimate"]["step_time_s"] == pytest.approx(alone["step_time_s"], rel=1e-12)
        assert s["per_gpu_vs_first"] == pytest.approx(alone["tokens_per_s"] / s["gpus"] / first)
        written = Plan.read(str(tmp_path / f"plan-{s['cluster']}-{s['gpus']}.json"))
        assert written.cluster.name == s["cluster"] and written.mesh.world_size == s["gpus"]
    # the same 8 GPUs on two nodes that share one NIC each: slower than on one node
    assert sizes[2]["estimate"]["step_time_s"] > sizes[0]["estimate"]["step_time_s"]
    assert main([*args, *both, "--gpus", "8,12"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[:3] == ["cluster", "GPUs", "nodes"] and "each cluster and size" in lines[0]
    assert "excluded, 12 GPUs of dgx-a100-80gb: --gpus: 12" in "\n".join(lines)
    picture = tmp_path / "clusters.png"
    assert main([*args, *both, "--gpus", "8", "--plot", str(picture)]) == 0
    assert picture.stat().st_size > 10_000


@pytest.mark.parametrize("cluster, extra, says", [
    ("dgx-a100-80gb,dgx-h100-80gb", ["-o", "plan-{gpus}.json"], "-o: plan-{gpus}.json would be written once per cluster"),
    ("dgx-a100-80gb,dgx-a100-80gb", [], "--cluster: two of these profiles are named dgx-a100-80gb"),
    ("dgx-a100-80gb,nope", [], "--cluster: 'nope' is neither a file nor a profile"),
    ("dgx-a100-80gb,", [], "--cluster: an empty name"),
])
def test_what_several_clusters_cannot_do_is_one_line(cluster, extra, says, capsys):
    args = [a for a in LLAMA if a not in ("--cluster", "dgx-a100-80gb")]
    assert main([*args, "--cluster", cluster, "--gpus", "8", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err


def test_several_clusters_are_for_search_only(capsys):
    assert main(["plan", "--model", "llama2-7b", "--cluster", "dgx-a100-80gb,dgx-h100-80gb", "--gpus", "8",
                 "--global-batch", "16", "--micro-batch", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith("several, comma-separated, are for `trident search`")
