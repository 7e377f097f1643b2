"""Dropout (runtime.dropout): hidden-state masks drawn per sequence and token, the same under every
plan; attention-probability dropout in the fused kernel, the same under any pipeline, ZeRO level
or recomputation; and the planner's price of both (training.dropout, training.attention_dropout)."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from planner.build import build_plan
from planner.cluster import load_cluster
from planner.cost import estimate
from planner.model import ConfigError
from planner.plan import Plan
from planner.precision import CPU_MATH_DROPOUT_BYTES
from planner.zoo import ZOO
from runtime.context_parallel import rank_positions
from runtime.dropout import EMBEDDING, MLP_OUT, Dropout, local_positions
from torchrun_helpers import REPO, assert_ok, assert_same_losses, losses_of, train, write_plan

CPU = torch.device("cpu")
S, H, P = 32, 64, 0.25


def _drop(x, first_row=0, micro=0, positions=None, step=3, layer=2, site=MLP_OUT, seed=0):
    d = Dropout(P, 0.0, seed, S, first_row, positions, 0, 0, CPU)
    d.step, d.micro = step, micro
    return d.hidden(x, d.key(x.shape[0]), layer, site)


def test_a_tokens_mask_is_the_same_whatever_part_of_the_batch_a_rank_holds():
    x = torch.randn(4, S, H)
    whole = _drop(x)
    kept = whole != 0
    assert abs(float((~kept).float().mean()) - P) < 0.1 * P  # 8192 draws
    assert torch.allclose(whole[kept], x[kept] / (1 - P))
    # rows: data-parallel rank 1 of 2 (its first row 2), or the second micro-batch of 2 rows
    assert torch.equal(_drop(x[2:], first_row=2), whole[2:])
    assert torch.equal(_drop(x[2:], micro=1), whole[2:])
    # tokens: sequence parallelism's second shard of 2; context parallelism's chunks of rank 1 of
    # 2, then their sequence shards (tp 2)
    sp = local_positions(S, None, True, 2, 1, CPU)
    assert torch.equal(_drop(x[:, S // 2:], positions=sp), whole[:, S // 2:])
    cp = rank_positions(S, 2, 1)
    assert torch.equal(_drop(x[:, cp], positions=local_positions(S, cp, False, 2, 0, CPU)), whole[:, cp])
    for tp_rank in (0, 1):
        rows = local_positions(S, cp, True, 2, tp_rank, CPU)
        assert torch.equal(_drop(x[:, rows], positions=rows), whole[:, rows])
    # another step, layer, site or seed: another mask
    for kw in (dict(step=4), dict(layer=3), dict(site=EMBEDDING), dict(seed=1)):
        assert not torch.equal(_drop(x, **kw) != 0, kept), kw


GPT = "tiny-gpt"
H100 = load_cluster("dgx-h100-80gb", nodes=1)


def test_dropout_trains_as_one_process_under_every_plan(tmp_path):
    """Hidden dropout alone (attention_dropout 0): tp 2 with SP, dp 2 with ZeRO 3 and micro-batches
    of one, cp 2 under full recompute, pp 2 under ZB-V with dp 2 (a replayed recompute), and tp 2
    resuming the last one's checkpoint: each step's loss is one process's. Both dropouts: a 1F1B pipeline with selective recompute gives
    one process's losses; the losses differ from those without dropout."""
    hidden = dict(dropout=0.1, attention_dropout=0.0)
    d = tmp_path / "plans"
    d.mkdir()
    refs = [write_plan(d, "ref", GPT, **hidden), write_plan(d, "ref-both", GPT, dropout=0.1),
            write_plan(d, "ref-none", GPT)]
    two = [write_plan(d, "tp2-sp", GPT, world=2, tp=2, sequence_parallel=True, **hidden),
           write_plan(d, "dp2-zero3", GPT, world=2, zero=3, micro_batch=1, **hidden),
           write_plan(d, "cp2-full", GPT, world=2, cp=2, recompute="full", **hidden),
           write_plan(d, "both-pp2", GPT, world=2, pp=2, schedule="1f1b", recompute="selective", dropout=0.1)]
    four = [write_plan(d, "pp2-dp2-zbv", GPT, world=4, pp=2, schedule="zbv", recompute="full", zero=1,
                       micro_batch=1, **hidden)]
    assert_ok(train(1, "--plan", *refs, "--steps", 3, "--out", tmp_path))
    assert_ok(train(2, "--plan", *two, "--steps", 3, "--out", tmp_path))
    ckpt = tmp_path / "ckpt"
    assert_ok(train(4, "--plan", *four, "--steps", 3, "--out", tmp_path / f"{four[0].stem}.json",
                    "--checkpoint-dir", ckpt, "--checkpoint-every", 2))
    # resumed under another plan at step 2: the masks of step 3 are the step's, whatever ran before
    assert_ok(train(2, "--plan", two[0], "--steps", 3, "--checkpoint-dir", ckpt, "--resume",
                    "--out", tmp_path / "resumed.json"))
    assert_same_losses(losses_of(tmp_path / "resumed.json"), losses_of(tmp_path / "ref.json")[2:], "resumed")
    want = {r.stem: losses_of(tmp_path / f"{r.stem}.json") for r in refs}
    for plan in two + four:
        assert_same_losses(losses_of(tmp_path / f"{plan.stem}.json"),
                           want["ref-both" if plan.stem.startswith("both") else "ref"], plan.stem)
    for a, b in (("ref", "ref-none"), ("ref-both", "ref"), ("ref-both", "ref-none")):
        assert abs(want[a][0] - want[b][0]) > 1e-4, (a, b, want)
    # attention dropout on CPU keeps the probabilities (precision.CPU_MATH_DROPOUT_BYTES): measured
    # 0.98-0.99 of the predictions
    for plan, out in ((refs[1], tmp_path / "ref-both.json"), (two[3], tmp_path / "both-pp2.json")):
        plan, run = Plan.read(plan), json.loads(out.read_text())
        cluster = dataclasses.replace(H100.shaped_as(1, plan.mesh.world_size), backend="gloo")
        for stage, pred in enumerate(estimate(plan, cluster).breakdown["memory_per_pp_rank"]):
            measured = max(m for r, m in enumerate(run["peak_memory_bytes_per_rank"])
                           if plan.mesh.coords(r)["pp"] == stage)
            assert 0.75 * pred <= measured <= 1.03 * pred, (out.stem, stage, measured / pred)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_attention_dropout_keeps_at_most_what_the_planner_counts(dtype):
    """scaled_dot_product_attention with dropout on CPU (its math path): the bytes autograd keeps
    beyond q and k, per (sequence, head, query, key)."""
    kept = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    b, heads, s, d = 2, 8, 64, 16
    q, k = (torch.randn(b, heads, s, d, dtype=dtype, requires_grad=True) for _ in range(2))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        torch.nn.functional.scaled_dot_product_attention(q, k, k, is_causal=True, dropout_p=0.1)
    per = (sum(kept.values()) - 2 * q.numel() * q.element_size()) / (b * heads * s * s)
    assert 12 < per <= CPU_MATH_DROPOUT_BYTES, per


A100 = load_cluster("dgx-a100-80gb", nodes=1)


def _est(**kw):
    plan = build_plan(ZOO["gpt-1.7b"], cluster_name=A100.name, device=A100.device.name, nodes=1, devices_per_node=8,
                      global_batch=16, micro_batch=2, tp=2, pp=2, sequence_parallel=True, **kw)
    return estimate(plan, A100)


def test_the_planner_prices_hidden_and_attention_dropout_apart():
    cfg, b, s = ZOO["gpt-1.7b"], 2, 2048
    none, hidden, both = _est(), _est(dropout=0.1, attention_dropout=0.0), _est(dropout=0.1)
    mem = lambda e: e.breakdown["memory"]["activations_bytes"]  # noqa: E731
    # the hidden masks: one byte an element, two a block (and the embedding's), split by SP over tp
    # 2, for the micro-batches in flight on the first stage (1F1B: pp of them)
    per_block = 2 * s * b * cfg.hidden / 2
    assert mem(hidden) - mem(none) == pytest.approx(2 * (per_block * cfg.layers / 2 + s * b * cfg.hidden / 2))
    # fused attention keeps no mask of the probabilities; an unfused one keeps it (and the output)
    assert mem(both) == mem(hidden)
    unfused = [_est(dropout=0.1, attention_dropout=a, attention="unfused") for a in (0.0, 0.1)]
    probs = cfg.heads * s * s * b / 2 * (1 + 2)
    assert mem(unfused[1]) - mem(unfused[0]) == pytest.approx(2 * probs * cfg.layers / 2)
    assert none.step_time_s < hidden.step_time_s  # the masks' kernels


def test_plan_files_and_the_command_line_carry_both_dropouts(tmp_path):
    path = write_plan(tmp_path, "p", GPT, dropout=0.1)
    assert "attention_dropout" not in json.loads(path.read_text())["training"]  # null: as dropout
    assert Plan.read(path).training.attention_dropout_p == 0.1
    path = write_plan(tmp_path, "q", GPT, dropout=0.1, attention_dropout=0.0)
    assert Plan.read(path).training.attention_dropout_p == 0.0
    data = json.loads(path.read_text())
    data["training"]["attention_dropout"] = 1.5
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="training.attention_dropout"):
        Plan.read(path)
    out = tmp_path / "cli.json"
    cmd = [sys.executable, "-m", "planner.cli", "plan", "--model", GPT, "--cluster", "dgx-a100-80gb", "--gpus", "2",
           "--global-batch", "8", "--micro-batch", "2", "--tp", "2", "--dropout", "0.1", "--attention-dropout", "0.05",
           "-o", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    assert_ok(proc)
    assert "dropout 0.1 (attention 0.05)" in proc.stdout
    t = Plan.read(out).training
    assert (t.dropout, t.attention_dropout) == (0.1, 0.05)
    bad = subprocess.run(cmd[:-2] + ["--attention-dropout", "1"], cwd=REPO, capture_output=True, text=True)
    assert bad.returncode == 2 and "--attention-dropout" in bad.stderr and "Traceback" not in bad.stderr
    assert dataclasses.replace(t, attention_dropout=None).attention_dropout_p == 0.1


@pytest.mark.parametrize("extra, layers", [(dict(dropout=0.1), (0, 1)), (dict(document_mask=True), (1,))])
def test_a_model_profile_measured_without_dropout_gets_its_price(model_profile, cluster_profile, extra, layers):
    """runtime.profile_model measures layers without dropout or a document mask; a plan with them
    priced from it pays their masks and kernels as the analytic model prices them, in the layers
    they touch (planner.unmeasured.unmeasured_delta)."""
    from planner.layers import layer_cost
    from planner.model_profile import load_model_profile, profiled_layer_cost
    mp, cluster = load_model_profile(str(model_profile)), load_cluster(str(cluster_profile))
    plans = [build_plan(ZOO["tiny"], cluster_name=cluster.name, device=cluster.device.name, nodes=1, devices_per_node=2,
                        global_batch=8, micro_batch=2, seq_len=32, tp=2, sequence_parallel=True, dtype="fp32",
                        **kw) for kw in ({}, extra)]
    stage, ranks = plans[0].pipeline.stages[0], [0, 1]
    for index in layers:  # the embedding, a block
        got = [profiled_layer_cost(p, cluster, index, stage, ranks, mp) for p in plans]
        want = [layer_cost(p, cluster, index, stage, ranks) for p in plans]
        for field in ("fwd_compute_s", "bwd_compute_s", "activation_bytes"):
            delta = getattr(want[1], field) - getattr(want[0], field)
            assert delta > 0 and getattr(got[1], field) - getattr(got[0], field) == pytest.approx(delta), (index, field)
    assert estimate(plans[1], cluster, model_profile=mp).step_time_s > estimate(plans[0], cluster,
                                                                                 model_profile=mp).step_time_s


def test_a_hugging_face_config_that_trains_with_dropout_gets_a_note(tmp_path):
    """GPT-2's config.json sets resid_pdrop, embd_pdrop and attn_pdrop 0.1: a plan without
    --dropout says how to plan with them; with them, no note."""
    cfg = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 512, "n_positions": 64,
           "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.05}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    cmd = [sys.executable, "-m", "planner.cli", "plan", "--model", str(path), "--cluster", "dgx-a100-80gb", "--gpus", "1",
           "--global-batch", "8", "--micro-batch", "2"]
    runs = [subprocess.run(cmd + extra, cwd=REPO, capture_output=True, text=True) for extra in
            ([], ["--dropout", "0.1", "--attention-dropout", "0.05"], ["--tp", "3"])]
    assert [r.returncode for r in runs] == [0, 0, 2], runs[0].stderr
    assert "trident: note:" in runs[0].stderr and "--dropout 0.1 --attention-dropout 0.05" in runs[0].stderr
    assert "note" not in runs[1].stderr
    # a plan refused: its error is the only line (the note comes once a plan is made)
    assert len(runs[2].stderr.splitlines()) == 1 and runs[2].stderr.startswith("trident: error: "), runs[2].stderr


@pytest.mark.parametrize("extra", [dict(elementwise_kernels="fused"), dict(tp_comm_overlap=True)])
def test_a_model_profile_prices_the_kernels_the_runtime_does_not_run(model_profile, cluster_profile, extra):
    """runtime.profile_model times the runtime's eager elementwise kernels and its TP collectives
    after their GEMMs; a plan with fused kernels, or with sequence parallelism's collectives beside
    the GEMMs, is priced from the profile plus the analytic model's difference, in compute or in TP
    time, not as if it ran the runtime's (planner.unmeasured)."""
    from planner.layers import layer_cost
    from planner.model_profile import load_model_profile, profiled_layer_cost
    mp, cluster = load_model_profile(str(model_profile)), load_cluster(str(cluster_profile))
    plans = [build_plan(ZOO["tiny"], cluster_name=cluster.name, device=cluster.device.name, nodes=1, devices_per_node=2,
                        global_batch=8, micro_batch=2, seq_len=32, tp=2, sequence_parallel=True, dtype="fp32",
                        **kw) for kw in ({}, extra)]
    stage, ranks = plans[0].pipeline.stages[0], [0, 1]
    got = [profiled_layer_cost(p, cluster, 1, stage, ranks, mp) for p in plans]  # a block
    want = [layer_cost(p, cluster, 1, stage, ranks) for p in plans]
    moved = 0
    for field in ("fwd_compute_s", "bwd_compute_s", "fwd_tp_s", "bwd_tp_s", "activation_bytes"):
        delta = getattr(want[1], field) - getattr(want[0], field)
        assert delta <= 0 and getattr(got[1], field) - getattr(got[0], field) == pytest.approx(delta), field
        moved += delta < 0
    assert moved and estimate(plans[1], cluster, model_profile=mp).step_time_s < estimate(
        plans[0], cluster, model_profile=mp).step_time_s
