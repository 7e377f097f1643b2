"""`trident search` on the command line: the plan it writes, its table, and constraints and bad
input in one line each (several cluster sizes at once: tests/test_sizing.py)."""
import json
from pathlib import Path

import pytest

from planner.cli import main
from planner.plan import Plan

GiB = 2**30


def test_cli_search_writes_a_plan_that_estimate_reproduces(tmp_path, capsys):
    out = tmp_path / "plan.json"
    args = ["search", "--model", "llama2-7b", "--cluster", "dgx-a100-80gb", "--gpus", "8", "--global-batch", "16",
            "--seq-len", "2048", "--memory-limit", "36", "--top", "3", "-o", str(out), "--json"]
    assert main(args) == 0
    found = json.loads(capsys.readouterr().out)
    alternatives = found.pop("alternatives")
    assert len(alternatives) == 2 and all(a["estimate"]["fits"] for a in alternatives)
    assert alternatives[0]["estimate"]["step_time_s"] >= found["step_time_s"]
    assert main(["estimate", str(out), "--memory-limit", "36", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == found
    assert json.loads(out.read_text())["prediction"]["step_time_s"] == found["step_time_s"]
    assert found["fits"] and found["required_memory_bytes"] <= 36 * GiB


def test_cli_search_for_another_framework_writes_its_settings_and_estimate_reproduces(tmp_path, capsys):
    """`trident search` takes how the framework runs the plan, as `trident plan` does (Megatron-LM's
    fused kernels, gradient accumulation and flat buffers here): the plan written carries them,
    `trident estimate` prices it the same, and the settings change the prediction."""
    out = tmp_path / "plan.json"
    base = ["search", "--model", "llama2-7b", "--cluster", "dgx-a100-80gb", "--gpus", "8", "--global-batch", "16",
            "--seq-len", "2048", "--top", "1", "--json"]
    megatron = ["--elementwise-kernels", "fused-fp32-loss", "--grad-accumulation", "fused", "--no-fsdp-copies",
                "--async-tp-allreduce", "--no-overlap-grad-reduce", "--sent-outputs", "freed", "--p2p", "scatter-gather"]
    assert main(base) == 0
    runtime = json.loads(capsys.readouterr().out)
    assert main([*base, *megatron, "-o", str(out)]) == 0
    found = json.loads(capsys.readouterr().out)
    t = json.loads(out.read_text())["training"]
    assert (t["elementwise_kernels"], t["grad_accumulation"], t["fsdp_copies"], t["async_tp_allreduce"],
            t["overlap_grad_reduce"]) == ("fused-fp32-loss", "fused", False, True, False)
    p = json.loads(out.read_text())["pipeline"]
    assert (p["sent_outputs"], p["p2p"]) == ("freed", "scatter-gather")
    assert main(["estimate", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step_time_s"] == found["step_time_s"] != runtime["step_time_s"]


def test_cli_search_table(capsys):
    assert main(["search", "--model", "small", "--cluster", "dgx-h100-80gb", "--gpus", "4", "--global-batch", "8",
                 "--top", "3"]) == 0
    text = capsys.readouterr().out
    assert "MFU" in text and "tokens/s" in text and "peak GiB" in text


def test_an_odd_sequence_length_is_searched_and_a_zero_aux_loss_accepted(tmp_path, capsys):
    """Only context parallelism splits a sequence into 2 x cp chunks: without it any length is
    searched (as `trident plan` prices it); --moe-aux-loss takes its default, 0."""
    base = ["--cluster", "dgx-a100-80gb", "--gpus", "8", "--global-batch", "16", "--seq-len", "4095", "--json"]
    assert main(["search", "--model", "llama2-7b", *base, "-o", str(tmp_path / "p.json")]) == 0
    assert Plan.read(tmp_path / "p.json").training.seq_len == 4095
    assert main(["search", "--model", "tiny", *base, "--moe-aux-loss", "0"]) == 2  # above tiny's 64 tokens
    assert "training.seq_len: 4095 exceeds the model's seq_len 64" in capsys.readouterr().err


def test_cli_nothing_fits_is_one_line_and_exit_3(capsys):
    rc = main(["search", "--model", "llama2-70b", "--cluster", "dgx-a100-80gb", "--gpus", "8", "--global-batch", "16"])
    assert rc == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no plan" in err[0] and "GiB" in err[0] and "least memory" in err[0]


def test_cli_search_keeps_to_the_constraints_given(tmp_path, capsys):
    """--tp, --pp, --dp, --micro-batch, --schedule, --zero, --recompute, --sequence-parallel and
    --even-stages narrow what the search may choose; every plan it shows keeps to them."""
    out = tmp_path / "plan.json"
    args = ["search", "--model", "small", "--cluster", "dgx-a100-80gb", "--gpus", "8", "--global-batch", "32",
            "--tp", "2", "--pp", "2", "--micro-batch", "2,4", "--schedule", "gpipe", "--zero", "1",
            "--recompute", "full", "--sequence-parallel", "on", "--even-stages", "--top", "4", "--json", "-o", str(out)]
    assert main(args) == 0
    found = json.loads(capsys.readouterr().out)
    plan = json.loads(out.read_text())
    assert (plan["mesh"]["tp"], plan["mesh"]["pp"], plan["mesh"]["dp"]) == (2, 2, 2)
    assert plan["training"]["micro_batch"] in (2, 4) and plan["pipeline"]["schedule"] == "gpipe"
    stages = plan["pipeline"]["stages"]
    assert {st["zero"] for st in stages} == {1} and all(st["sequence_parallel"] for st in stages)
    blocks = [r for st in stages for r in st["recompute"]][1:-1]  # the embedding and the head have no mode
    assert set(blocks) == {"full"}
    sizes = [b - a for a, b in (st["layers"] for st in stages)]
    assert sizes == [sizes[0]] * len(sizes)  # even: the embedding and the head count as layers
    for alt in found["alternatives"]:
        d = alt["degrees"]
        assert (d["tp"], d["pp"], d["schedule"]) == (2, 2, "gpipe") and d["micro_batch"] in (2, 4)
    # without them the same problem's best plan is another one: the constraints did the narrowing
    assert main(args[:9] + ["--top", "1", "--json"]) == 0
    free = json.loads(capsys.readouterr().out)
    assert free["step_time_s"] < found["step_time_s"]


@pytest.mark.parametrize("extra, names", [
    (["--pp", "3"], ["--pp: 3 admits no configuration", "possible: 1, 2, 4"]),  # tiny has 6 layers
    (["--tp", "2", "--pp", "2", "--dp", "4"], ["admits no configuration", "possible: 1"]),
    (["--tp", "2", "--pp", "2", "--dp", "4", "--micro-batch", "3"], ["together these admit no configuration",
                                                                      "--micro-batch 3"]),
    (["--virtual-stages", "2", "--schedule", "1f1b"], ["--virtual-stages", "interleaved-1f1b"]),
])
def test_cli_search_constraints_that_admit_nothing_say_which_in_one_line(capsys, extra, names):
    assert main(["search", "--model", "tiny", "--cluster", "dgx-a100-80gb", "--gpus", "8", "--global-batch", "64",
                 *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and all(n in err[0] for n in names), err


@pytest.mark.parametrize("extra, name", [
    (["--zero", "5"], "argument --zero: 5 must be from 0 to 3"),
    (["--schedule", "zb"], "argument --schedule: 'zb' is not one of gpipe, 1f1b, interleaved-1f1b"),
    (["--tp", "two"], "argument --tp: 'two' is not a comma-separated list of integers"),
    (["--virtual-stages", "1"], "argument --virtual-stages: 1 must be at least 2"),
])
def test_cli_search_malformed_constraints_are_one_line(capsys, extra, name):
    with pytest.raises(SystemExit) as exc:
        main(["search", "--model", "tiny", "--cluster", "dgx-a100-80gb", "--gpus", "8", "--global-batch", "64", *extra])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and name in err[0], err


def test_cli_search_nothing_fits_under_constraints_names_them(capsys):
    rc = main(["search", "--model", "llama2-70b", "--cluster", "dgx-a100-80gb", "--gpus", "8", "--global-batch", "16",
               "--zero", "0", "--recompute", "none"])
    assert rc == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "under --zero 0 --recompute none" in err[0] and "lift a constraint" in err[0]


def _derived(tmp_path, base, *flags):
    out = tmp_path / f"{base}-{'-'.join(flags).replace('--', '')}.json"
    assert main(["cluster", "derive", base, *flags, "-o", str(out)]) == 0
    return str(out)


@pytest.mark.parametrize("model, base, flags, gpus, batch, seq", [
    # 1F1B tp2 pp6 dp2: its split at T* does not fit, others do; it was dropped for that (session 56: 7.49 s
    # plan, not 7.29; session 57 finds 6.33 s both ways)
    ("llama2-70b", "dgx-h100-80gb", ("--devices-per-node", "4", "--nic-gbps", "200"), 24, 32, 4096),
    # ZB-V tp1 pp3 dp4: its split at T* prices 13% above its best; polished, it is kept (session 56: 5.47 s,
    # not 5.62; session 57: 5.238 s both ways)
    ("llama2-7b", "dgx-a100-80gb", ("--devices-per-node", "4", "--nics-per-node", "1"), 12, 64, 4096),
])
def test_the_quick_key_keeps_what_the_thorough_search_finds(tmp_path, capsys, model, base, flags, gpus, batch, seq):
    cluster = _derived(tmp_path, base, *flags)
    args = ["search", "--model", model, "--cluster", cluster, "--gpus", str(gpus), "--global-batch", str(batch),
            "--seq-len", str(seq), "--top", "1", "--json"]
    capsys.readouterr()
    got = []
    for extra in ([], ["--thorough"]):
        assert main([*args, *extra]) == 0
        got.append(json.loads(capsys.readouterr().out)["step_time_s"])
    assert got[0] == got[1]


def test_thorough_search_expands_what_the_quick_split_would_drop(tmp_path, capsys, monkeypatch):
    """Llama 2 7B on three nodes of 4 H100s with 100 Gb/s NICs, global batch 64 at 4k tokens. With
    the quick pass keying a configuration of several chunks a rank by its stage-level split alone
    (SearchSpace.quick_rank_split False, as until session 56), a --top 1 search returns 1.991 s;
    --thorough expands a configuration whose quick split priced above that and finds 1.975 s, and
    its answer does not depend on --top. The quick pass with the split that balances ranks at the
    best bottleneck (the default) finds it too. Flat data parallelism only (--dp-replicate 1: the
    search asked for --top plans). Earlier cases: 200 Gb/s NICs, global batch 64 at 2k tokens
    (0.920 s against 0.901 s, until session 58 priced compute slowed by the collectives beside it),
    100 Gb/s NICs, global batch 32 at 4k tokens
    (1.046 s against 1.002 s, until session 57 priced the gradients' reduction beside the last
    backward), the same with 200 Gb/s at 2k tokens (0.947 s against 0.929 s, until ZeRO 1's gather
    was priced beside the next forward in session 56) and global batch 128 (1.90 s against 1.80 s,
    until session 43's rank-balanced splits in the full sweep)."""
    import dataclasses
    import planner.search
    cluster = _derived(tmp_path, "dgx-h100-80gb", "--devices-per-node", "4", "--nic-gbps", "100")
    args = ["search", "--model", "llama2-7b", "--cluster", cluster, "--gpus", "12", "--global-batch", "64",
            "--seq-len", "4096", "--dp-replicate", "1", "--json"]
    search = planner.search.search

    def stage_level_quick(*a, space=None, **kw):
        return search(*a, space=dataclasses.replace(space, quick_rank_split=False), **kw)
    capsys.readouterr()
    got = {}
    for extra in (["--top", "1"], ["--top", "1", "--thorough"], ["--top", "5", "--thorough"]):
        with monkeypatch.context() as patch:
            patch.setattr(planner.search, "search", stage_level_quick)
            assert main([*args, *extra]) == 0
        got[" ".join(extra)] = json.loads(capsys.readouterr().out)
    quick, thorough, thorough5 = got.values()
    assert thorough["step_time_s"] == thorough5["step_time_s"]
    # 1.975 s against 1.991 s today; should the quick split find it one day, find another case
    assert thorough["step_time_s"] < quick["step_time_s"] * 0.995
    # the ZB-V plan: 3 pipeline ranks of 2 chunks
    assert len(thorough["stages"]) == 6 and {st["pp_rank"] for st in thorough["stages"]} == {0, 1, 2}
    assert main([*args, "--top", "1"]) == 0  # the default quick pass
    assert json.loads(capsys.readouterr().out)["step_time_s"] == pytest.approx(thorough["step_time_s"], rel=1e-9)


def test_the_search_is_asked_for_hsdps_pool_unless_it_searches_the_replica_counts(monkeypatch, capsys):
    """`trident search` asks the search for HSDP_POOL flat plans at least, so that the splits it
    prices do not depend on --top; with --dp-replicate the search also takes the replica counts
    as a dimension of its own, and with --dp-replicate 1 (no HSDP) it is asked for --top plans
    alone. (The parsed counts are a tuple: compared with the list [1], --dp-replicate 1 asked for
    5 until session 42.)"""
    import planner.search
    from planner.hsdp import HSDP_POOL
    asked, real = [], planner.search.search

    def spy(*args, **kw):
        asked.append((kw["top"], kw["space"].dp_replicate))
        return real(*args, **kw)
    monkeypatch.setattr(planner.search, "search", spy)
    args = ["search", "--model", "tiny", "--cluster", "dgx-a100-80gb", "--gpus", "4", "--global-batch", "8",
            "--top", "1", "--json"]
    for extra in ([], ["--dp-replicate", "1"], ["--dp-replicate", "1,2"]):
        assert main([*args, *extra]) == 0
        capsys.readouterr()
    assert asked == [(HSDP_POOL, (1,)), (1, (1,)), (HSDP_POOL, (1, 2))]


def test_the_search_balances_a_ranks_chunks_not_only_its_stages(tmp_path, capsys):
    """With several chunks a rank (ZB-V) the full sweep tries splits that balance the ranks' summed
    chunks (planner.rank_split): Llama 2 13B on three nodes of 4 H100s with
    200 Gb/s NICs, global batch 128, comes out at 3.378 s on pp 6, each rank 7 blocks (rank 0: 5
    beside the embedding and the head). Until session 43 the stage-level splits and their polish
    found 3.542 s at best (pp 3, ZB-V). The nodes' BF16 products run at the MAMF burst these figures
    were found with (0.803 of peak; the shipped profile prices the sustained rate since session 60)."""
    cluster = _derived(tmp_path, "dgx-h100-80gb", "--devices-per-node", "4", "--nic-gbps", "200")
    d = json.loads(Path(cluster).read_text())
    d["device"]["matmul_efficiency"]["bf16"] = 0.803
    Path(cluster).write_text(json.dumps(d))
    out = tmp_path / "plan.json"
    capsys.readouterr()
    assert main(["search", "--model", "llama2-13b", "--cluster", cluster, "--gpus", "12", "--global-batch", "128",
                 "--seq-len", "2048", "--json", "-o", str(out)]) == 0
    found = json.loads(capsys.readouterr().out)
    plan = Plan.from_json(out.read_text())
    assert found["step_time_s"] < 3.542 * 0.97 and plan.pipeline.schedule == "zbv"
    blocks = [sum(1 for i in range(st.start, st.end) if plan.model.layer_kind(i) == "block")
              for st in plan.pipeline.stages]
    per_rank = [blocks[r] + blocks[2 * plan.mesh.pp - 1 - r] for r in range(plan.mesh.pp)]
    assert max(per_rank[1:]) - min(per_rank[1:]) <= 1, per_rank
