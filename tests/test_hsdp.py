"""HSDP (mesh.dp_replicate): ZeRO shards over groups of dp / dp_replicate ranks and all-reduces the
shards across the replicas. The plan's groups, its checks, its price, and the runtime training
with it like one process while all-reducing across the replicas once a step."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from planner.cli import main
from planner.cluster import PROFILE_DIR, cluster_from_dict, load_cluster
from planner.cost import estimate
from planner.model import ConfigError
from planner.plan import Mesh, Plan
from planner.build import build_plan
from planner.hsdp import replica_counts
from planner.zoo import ZOO
from torchrun_helpers import assert_ok, assert_same_losses, losses_of, ranks, train, write_plan

A100 = load_cluster("dgx-a100-80gb")


def plan_for(nodes=4, **kw):
    args = dict(cluster_name=A100.name, device=A100.device.name, nodes=nodes, devices_per_node=8,
                global_batch=64, micro_batch=1, seq_len=2048, zero=3)
    return build_plan(ZOO["llama2-7b"], **{**args, **kw})


@pytest.mark.parametrize("order", [["pp", "dp", "tp"], ["dp", "pp", "tp"], ["tp", "dp", "pp"]])
def test_shard_and_replica_groups_split_dp_replicas_outside_rank_by_rank(order):
    mesh = Mesh(pp=2, dp=12, tp=2, order=order, dp_replicate=3)
    assert mesh.dp_shard == 4
    for rank in range(mesh.world_size):
        c = mesh.coords(rank)
        same = [r for r in range(mesh.world_size)
                if all(mesh.coords(r)[d] == c[d] for d in ("pp", "tp"))]
        shard = [r for r in same if mesh.coords(r)["dp"] // 4 == c["dp"] // 4]
        replicas = [r for r in same if mesh.coords(r)["dp"] % 4 == c["dp"] % 4]
        assert list(mesh.shard_group(**c)) == shard and list(mesh.replicate_group(**c)) == replicas
    plain = Mesh(pp=2, dp=12, tp=2, order=order)
    assert list(plain.shard_group(pp=1, dp=5, tp=0)) == list(plain.group("dp", pp=1, tp=0))
    assert list(plain.replicate_group(pp=1, dp=5, tp=0)) == [plain.rank(pp=1, dp=5, tp=0)]


@pytest.mark.parametrize("kw, says", [
    (dict(dp_replicate=3), "must divide dp=32"),
    (dict(dp_replicate=32), "leave a shard group of at least 2"),
    (dict(dp_replicate=0), "must be a positive integer"),
    (dict(dp_replicate=2, zero=0), "needs ZeRO 1-3 on every stage"),
])
def test_impossible_replica_counts_are_refused_naming_the_field(kw, says):
    with pytest.raises(ConfigError) as exc:
        plan_for(**kw)
    assert str(exc.value).startswith("mesh.dp_replicate: ") and says in str(exc.value)


def test_dp_replicate_is_written_only_when_used_and_round_trips():
    assert "dp_replicate" not in json.loads(plan_for().to_json())["mesh"]
    text = plan_for(dp_replicate=4).to_json()
    assert json.loads(text)["mesh"]["dp_replicate"] == 4
    back = Plan.from_json(text)
    assert back.mesh.dp_shard == 8 and back.to_json() == text
    assert back.content_hash() != plan_for().content_hash()


def test_hsdp_shards_states_over_the_shard_group_and_adds_the_replicas_all_reduce():
    # ZeRO 1, one micro-batch, gradients reduced after the backward: a step's data-parallel time
    # is the reduce-scatter over the shard group, the replicas' all-reduce of the shard and the
    # gather after the optimizer step (not beside the next forward), one after the other
    kw = dict(zero=1, global_batch=32, overlap_grad_reduce=False, overlap_param_gather=False)
    flat, hsdp = estimate(plan_for(**kw), A100), estimate(plan_for(dp_replicate=4, **kw), A100)
    plan = plan_for(dp_replicate=4, **kw)
    shard, replicas = plan.mesh.shard_group(pp=0, tp=0), plan.mesh.replicate_group(pp=0, tp=0)
    assert list(shard) == list(range(8)) and list(replicas) == [0, 8, 16, 24]  # a node, one rank a node
    params = hsdp.stages[0]["params"]
    grads = params * 4  # float32 gradients under bf16 mixed precision
    want = (A100.shaped_as(4, 8).collective_time("reduce_scatter", grads, shard)
            + A100.shaped_as(4, 8).collective_time("all_reduce", grads / 8, replicas))
    assert hsdp.stages[0]["grad_sync_s"] == pytest.approx(want)
    gather = A100.shaped_as(4, 8).collective_time("all_gather", params * 2, shard)
    assert hsdp.breakdown["time"]["dp_comm_exposed_s"] == pytest.approx(want + gather)
    # optimizer states over 8 ranks, not 32
    mem = (flat.breakdown["memory"], hsdp.breakdown["memory"])
    assert mem[1]["optimizer_bytes"] == pytest.approx(4 * mem[0]["optimizer_bytes"])
    assert mem[1]["parameters_bytes"] == pytest.approx(mem[0]["parameters_bytes"])  # ZeRO 1: whole


# -------------------------------------------------------------------- the runtime
STEPS = 3


def test_hsdp_trains_like_one_process_and_all_reduces_across_replicas_once_a_step(tmp_path):
    """Eight gloo processes: HSDP of 2 replicas x 2 shards with TP 2 (ZeRO 2, two micro-batches,
    and one), and under a zbv pipeline (ZeRO 3, split backward); each holds what the planner
    counts for it (its states sharded over 2 ranks, not 4)."""
    d = tmp_path / "plans"
    d.mkdir()
    ref = write_plan(d, "ref")
    plans = [write_plan(d, "hsdp-tp2-zero2", world=8, tp=2, zero=2, dp_replicate=2, micro_batch=1),
             write_plan(d, "hsdp-tp2-zero2-one", world=8, tp=2, zero=2, dp_replicate=2, micro_batch=2),
             write_plan(d, "hsdp-pp2-zbv", world=8, pp=2, zero=3, dp_replicate=2, micro_batch=1, schedule="zbv")]
    assert_ok(train(1, "--plan", ref, "--steps", STEPS, "--out", tmp_path / "ref.json"))
    want = losses_of(tmp_path / "ref.json")
    assert_ok(ranks(8, "tests.hsdp_probe", tmp_path / "counts", "--plan", *plans, "--steps", STEPS,
                    "--out", tmp_path / "runs"))
    # memory does not depend on the device's speed; it does on the collectives' library
    cluster = dataclasses.replace(A100.shaped_as(1, 8), backend="gloo")
    for p in plans:
        run = json.loads((tmp_path / "runs" / f"{p.stem}.json").read_text())
        assert_same_losses(run["losses"], want, p.stem)
        plan = Plan.read(p)
        for stage, pred in enumerate(estimate(plan, cluster).breakdown["memory_per_pp_rank"]):
            measured = max(m for r, m in enumerate(run["peak_memory_bytes_per_rank"])
                           if plan.mesh.coords(r)["pp"] == stage)
            # flat twins of these plans measure 0.86-0.87 (TP 2) and 0.77 (ZB-V) of their predictions;
            # ZB-V's rank 0 measured 0.75-0.76: the last reduce-scatter input of its first chunk's W
            # (a block's) is counted held all step, where that W comes after the rank's peak
            low = 0.70 if plan.pipeline.schedule == "zbv" else 0.75
            assert low * pred <= measured <= 1.03 * pred, (p.stem, stage, measured / pred)
    # rank 0 holds the shard of dp 0, as dp 2 does: rank 4 under tp 2, rank 2 in the pipeline
    counts = json.loads((tmp_path / "counts" / "rank0.json").read_text())
    two, one = counts["hsdp-tp2-zero2"].get("0,4", 0), counts["hsdp-tp2-zero2-one"].get("0,4", 0)
    # one per FSDP2 group (each block, the embedding and the head; the root holds nothing of its
    # own) a step, whatever the micro-batch count
    assert two == one == (ZOO["tiny"].layers + 2) * STEPS
    # zbv: rank 0 holds stages 0 (embedding, block 1) and 3 (block 4, head): four groups
    assert counts["hsdp-pp2-zbv"].get("0,2", 0) == 4 * STEPS


# -------------------------------------------------------------------- the search
def slow_large_groups(tmp_path):
    """dgx-a100-80gb where collectives over 32 ranks across nodes run at 1 GB/s after 5 ms: a
    measured profile of a network whose large groups are slow."""
    d = json.loads((PROFILE_DIR / "dgx-a100-80gb.json").read_text())
    d["name"] = "slow-large-groups"
    for op in ("all_gather", "reduce_scatter", "all_reduce"):
        d["collectives"][op]["inter_node"]["by_group_size"] = {
            "32": {"alpha_s": 5e-3, "bus_bandwidth_bytes_per_s": 1e9}}
    path = tmp_path / "slow.json"
    path.write_text(json.dumps(d))
    return path


@pytest.mark.parametrize("slow", [True, False])
def test_the_search_splits_dp_into_replicas_where_the_profile_prices_that_faster(slow, tmp_path, capsys):
    cluster = str(slow_large_groups(tmp_path)) if slow else "dgx-a100-80gb"
    out = tmp_path / "plan.json"
    assert main(["search", "--model", "llama2-7b", "--cluster", cluster, "--nodes", "4", "--global-batch", "64",
                 "--tp", "1", "--pp", "1", "--top", "2", "-o", str(out), "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    plan = Plan.from_json(out.read_text())
    profile = cluster_from_dict(json.loads(Path(cluster).read_text())) if slow else load_cluster(cluster)
    profile = profile.with_nodes(4)
    flat = estimate(dataclasses.replace(plan, mesh=dataclasses.replace(plan.mesh, dp_replicate=1)), profile)
    if not slow:  # the flat ring is not slower on the shipped profiles (planner.hsdp)
        assert plan.mesh.dp_replicate == 1 and all(a["degrees"]["dp_replicate"] == 1 for a in found["alternatives"])
        return
    assert plan.mesh.dp_replicate in replica_counts(32) and found["step_time_s"] < flat.step_time_s
    assert found["step_time_s"] == pytest.approx(estimate(plan, profile).step_time_s)
    assert found["alternatives"][0]["estimate"]["step_time_s"] >= found["step_time_s"]


def test_the_search_keeps_to_the_replica_counts_it_is_given(tmp_path, capsys):
    base = ["search", "--model", "llama2-7b", "--nodes", "4", "--global-batch", "64", "--tp", "1", "--pp", "1",
            "--top", "2", "--json", "--cluster"]

    def replicas(cluster, allowed):
        assert main(base + [cluster, "--dp-replicate", allowed, "-o", str(tmp_path / "p.json")]) == 0
        found = json.loads(capsys.readouterr().out)
        return [Plan.from_json((tmp_path / "p.json").read_text()).mesh.dp_replicate] + [
            a["degrees"]["dp_replicate"] for a in found["alternatives"]]
    assert replicas(str(slow_large_groups(tmp_path)), "1") == [1, 1]  # flat only, where HSDP is faster
    assert set(replicas("dgx-a100-80gb", "4,8")) <= {4, 8}  # split only, where it is slower
    assert main(base + ["dgx-a100-80gb", "--dp-replicate", "3"]) == 2  # 3 does not divide dp 32
    err = capsys.readouterr().err
    assert "--dp-replicate: 3 admits no configuration" in err and "possible: 1, 2, 4, 8, 16" in err


def test_asked_for_replica_counts_the_search_searches_them_beyond_the_flat_plans_split(tmp_path, capsys):
    """With --dp-replicate the replica count is a dimension of the search (planner.configs), so its
    partitions, ZeRO levels and micro-batches are chosen under HSDP's own costs. Before session 43
    the flat search's best 5 plans were split after the fact: Llama 3 8B on two DGX H100 nodes
    came out at 13.52 s (tp1 pp4 interleaved, 2 x 2) where 2 x 8 with ZeRO 3 and no pipeline takes
    13.33 s, and the tiny model on 6 GPUs, whose best flat plans all replicate (ZeRO 0), had no
    plan at all (exit 3, 'no plan fits'). Since session 58 (a collective beside compute slows it)
    the searched plan is 13.46 s, the best split 13.50 s."""
    from planner.hsdp import with_hsdp
    from planner.model_files import load_model
    from planner.search import search
    args = ["search", "--model", "llama3-8b", "--cluster", "dgx-h100-80gb", "--nodes", "2", "--global-batch", "256",
            "--dp-replicate", "2", "--json", "-o", str(tmp_path / "p.json")]
    assert main(args) == 0
    found = json.loads(capsys.readouterr().out)
    assert Plan.from_json((tmp_path / "p.json").read_text()).mesh.dp_replicate == 2
    # every split into 2 replicas of the 40 best flat plans is slower
    h100 = load_cluster("dgx-h100-80gb").with_nodes(2)
    flat = search(load_model("llama3-8b"), h100, global_batch=256, top=40).results
    split = with_hsdp(flat, h100, allowed=[2])
    assert split and found["step_time_s"] < split[0].estimate.step_time_s
    assert main(["search", "--model", "tiny", "--cluster", "hgx-h200-141gb", "--gpus", "6", "--global-batch", "24",
                 "--dp-replicate", "2", "-o", str(tmp_path / "t.json")]) == 0
    mesh = Plan.from_json((tmp_path / "t.json").read_text()).mesh
    assert (mesh.dp_replicate, mesh.dp) == (2, 6)
