"""Sequence parallelism's saved inputs (training.sp_saved_inputs): the runtime keeps the sequence
shard of what its column-parallel linears gather and gathers it again in the backward, as
Megatron-LM does (runtime.sp_shard, the default), or keeps the gathered input whole, as DTensor's
ColwiseParallel alone does (planner.precision.sp_gathered_bytes, planner.comm.regathers)."""
import dataclasses
import json
import subprocess
import sys
from functools import partial

import pytest

from planner.build import build_plan
from planner.cluster import load_cluster
from planner.cost import estimate
from planner.layers import layer_cost
from planner.plan import Plan, Training
from planner.precision import runtime_held_bytes, sp_gathered_bytes
from planner.search import search
from planner.sp_modes import search_either
from planner.zoo import ZOO
from runtime.metrics import HEAP_READER
from runtime.launch import free_port
from torchrun_helpers import REPO, env


def _plan(sp=True, saved="shard", recompute="none", model="llama3-70b", schedule="1f1b"):
    return build_plan(ZOO[model], cluster_name="dgx-h100-80gb", device="H100", nodes=8, devices_per_node=8,
                      global_batch=64, micro_batch=1, seq_len=8192, tp=8, pp=4, schedule=schedule,
                      recompute=recompute, sequence_parallel=sp, dtype="bf16", sp_saved_inputs=saved)


def test_gathered_inputs_add_what_the_shards_leave_out():
    cfg, t = ZOO["llama3-70b"], Training(global_batch=64, micro_batch=1, seq_len=8192, sp_saved_inputs="gathered")
    whole = 2 * 8192 * cfg.hidden  # one bf16 input of the residual stream's shape, whole
    for index, kind, inputs in ((1, "block", 2), (cfg.num_layers_total - 1, "head", 1), (0, "embedding", 0)):
        assert cfg.layer_kind(index) == kind
        assert sp_gathered_bytes(cfg, t, index, "none", 1, 8192, 8, True) == inputs * whole * 7 / 8
        assert sp_gathered_bytes(cfg, t, index, "selective", 1, 8192, 8, True) == inputs * whole * 7 / 8
    assert sp_gathered_bytes(cfg, t, 1, "full", 1, 8192, 8, True) == 0  # only the block's input is kept
    assert sp_gathered_bytes(cfg, t, 1, "none", 1, 8192, 8, False) == 0  # without SP every rank holds them whole
    assert sp_gathered_bytes(cfg, t, 1, "none", 1, 8192, 1, True) == 0
    shard = Training(global_batch=64, micro_batch=1, seq_len=8192)
    assert shard.sp_saved_inputs == "shard" and sp_gathered_bytes(cfg, shard, 1, "none", 1, 8192, 8, True) == 0


def test_the_estimate_counts_gathered_inputs_per_micro_batch_in_flight():
    cluster = load_cluster("dgx-h100-80gb", nodes=8)
    gathered, shard = estimate(_plan(saved="gathered"), cluster), estimate(_plan(), cluster)
    rank0 = lambda e: e.breakdown["memory"]["activations_bytes"]  # noqa: E731
    cfg = ZOO["llama3-70b"]
    assert gathered.breakdown["memory"]["pp_rank"] == shard.breakdown["memory"]["pp_rank"] == 0
    # rank 0 of pp 4 under 1F1B: 4 micro-batches in flight, 20 blocks (and the embedding) each
    blocks = sum(1 for i in range(*_plan().pipeline.stages[0].layers) if cfg.layer_kind(i) == "block")
    extra = 4 * blocks * 2 * (2 * 8192 * cfg.hidden) * 7 / 8
    assert rank0(gathered) - rank0(shard) == pytest.approx(extra, rel=1e-9)
    # keeping shards gathers again in the backward: two all-gathers a block, one in the head
    again = cluster.collective_time("all_gather", 2 * 8192 * cfg.hidden, list(range(8)))
    for index, gathers in ((1, 2), (cfg.num_layers_total - 1, 1), (0, 0)):
        costs = [layer_cost(p, cluster, index, next(st for st in p.pipeline.stages if st.start <= index < st.end),
                            list(range(8))) for p in (_plan(), _plan(saved="gathered"))]
        assert costs[0].bwd_tp_s - costs[1].bwd_tp_s == pytest.approx(gathers * again, rel=1e-9)
        assert costs[0].fwd_tp_s == costs[1].fwd_tp_s
        # ZB-V's split backward gathers them twice: in I (which unpacks them) and in W
        zbv = [_plan(saved=saved, schedule="zbv") for saved in ("shard", "gathered")]
        costs = [layer_cost(p, cluster, index, next(st for st in p.pipeline.stages if st.start <= index < st.end),
                            list(range(8))) for p in zbv]
        assert costs[0].bwd_tp_s - costs[1].bwd_tp_s == pytest.approx(2 * gathers * again, rel=1e-9)
    assert shard.step_time_s > gathered.step_time_s
    # a fully recomputed block keeps its input alone and gathers as its forward replays: the same
    full = [layer_cost(p, cluster, 1, p.pipeline.stages[0], list(range(8)))
            for p in (_plan(recompute="full"), _plan(saved="gathered", recompute="full"))]
    assert full[0] == full[1]
    # without sequence parallelism the option changes nothing
    a, b = estimate(_plan(sp=False), cluster), estimate(_plan(saved="gathered", sp=False), cluster)
    assert (a.peak_memory_bytes, a.step_time_s) == (b.peak_memory_bytes, b.step_time_s)


def test_the_option_round_trips_from_the_command_line(tmp_path, capsys):
    from planner.cli import main
    assert "sp_saved_inputs" not in _plan().to_dict()["training"]  # format 1 plans stay as they were
    out = tmp_path / "p.json"
    base = ["plan", "--model", "llama3-70b", "--cluster", "dgx-h100-80gb", "--gpus", "64", "--global-batch", "64",
            "--micro-batch", "1", "--tp", "8", "--pp", "4", "--sequence-parallel", "--json", "-o", str(out)]
    assert main(base) == 0  # keeping shards fits an 80 GB H100 ...
    assert json.loads(capsys.readouterr().out)["fits"]
    assert main(base + ["--sp-saved-inputs", "gathered"]) != 0  # ... keeping the gathered inputs does not
    assert "the plan needs" in capsys.readouterr().err
    assert json.loads(out.read_text())["training"]["sp_saved_inputs"] == "gathered"
    assert Plan.read(out).training.sp_saved_inputs == "gathered"
    # the search takes the mode too (here with ZeRO 1 the gathered inputs fit)
    assert main(["search", "--model", "llama3-70b", "--cluster", "dgx-h100-80gb", "--gpus", "64", "--global-batch",
                 "64", "--tp", "8", "--pp", "4", "--sequence-parallel", "on", "--micro-batch", "1", "--schedule",
                 "1f1b", "--zero", "1", "--sp-saved-inputs", "gathered", "--top", "1", "-o", str(out)]) == 0
    assert Plan.read(out).training.sp_saved_inputs == "gathered"
    # either mode: here keeping the gathered inputs fits, and is faster
    assert main(["search", "--model", "llama3-70b", "--cluster", "dgx-h100-80gb", "--gpus", "64", "--global-batch",
                 "64", "--tp", "8", "--pp", "4", "--sequence-parallel", "on", "--micro-batch", "1",
                 "--sp-saved-inputs", "either", "--top", "3", "-o", str(out)]) == 0
    assert Plan.read(out).training.sp_saved_inputs == "gathered"
    assert "gathered" in capsys.readouterr().out


def test_the_runtime_keeps_shards_and_computes_the_same():
    """Two processes, the tiny model under TP 2 with SP (tests/sp_probe.py), micro-batch 4 of 64
    tokens: a forward keeps what the planner counts in either mode, in float32 (6.04 and 6.70 MB
    measured against 6.30 and 6.89 counted: on CPU the planner rounds autograd's records up) and
    under bf16 autocast over float32 weights (4.97 and 5.84 MB against 5.05 and 5.84: the float32
    shard kept for the casts, not the casts); the shards spare what sp_gathered_bytes counts (654
    KB measured, 590 KB counted: keeping shards also keeps each other saved tensor as a detached
    alias, without its autograd record, 46-59 KB fewer since session 35); both modes give the same
    loss and gradients bit for bit; a split
    backward (zbv) gathers each kept input once in I and once in W, and leaves nothing behind (the
    saved outputs W does not read stayed with their autograd nodes, 862 KB of two blocks a pass:
    runtime.sp_shard detaches what it saves as is); the norms' partial gradients are made whole in
    one all-reduce; the norms run as CUDA runs them (aten._fused_rms_norm) give the same step."""
    from planner.layers import layer_params_on_device, partial_grad_params, replicated_params
    if HEAP_READER is None:
        pytest.skip("the C library does not report its heap here")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           str(REPO / "tests" / "sp_probe.py")]
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    assert got["same"]
    # a split backward gathers each kept input (two a block) once in I and once in W, as
    # planner.comm.regathers prices it (W gathered once per reading linear before: 5 a block)
    split = got["split_gathers"]
    assert (split["I"], split["W"]) == (4, 4)
    cfg, b, s = ZOO["tiny"], 4, 64
    # what two blocks' split backward leaves once its tensors are gone (after the first pass, which
    # builds DTensor's caches): 50 KB measured, where the leak left 862 KB a pass
    two_blocks = 2 * cfg.activation_bytes(1, 2, s, tp=2, sequence_parallel=True, bytes_per_element=4)
    assert min(split["left"][1:]) < 0.1 * two_blocks, (split["left"], two_blocks)
    # the norms' gradients (2 a block and the final norm's, and Qwen3's q and k norms, 2 a block)
    # are partial sums over the TP group, as many as the planner prices; reduce_partial_grads makes
    # them whole with one all-reduce, equal to DTensor's reduction of each; every gradient is one
    # process's (float32; the q and k norms' declared Replicate, unreduced, are 1.47 off)
    qwen3 = dataclasses.replace(cfg, qk_norm=True)
    plan = build_plan(qwen3, cluster_name="x", device="x", nodes=1, devices_per_node=2, global_batch=2,
                      micro_batch=2, seq_len=s, tp=2, sequence_parallel=True)
    grads = got["partial_grads"]
    assert grads.pop("vs_one") < 1e-5
    # every norm (2 a block, q and k's, the final one) run as CUDA runs it, aten._fused_rms_norm through
    # DTensor's rules for it: the loss and gradients of the decomposed norms (bit for bit here)
    fused = got["fused_norms"]
    assert fused["calls"] == 4 * cfg.layers + 1 and fused["loss"] < 1e-6 and fused["worst"] < 1e-6, fused
    assert grads == {"partial": 4 * cfg.layers + 1, "numel": partial_grad_params(plan, 0), "all_reduces": 1,
                     "whole": True, "left": 0}
    counted = {}
    for dtype, band in (("fp32", (1.0, 1.06)), ("bf16", (0.98, 1.03))):
        for saved in ("shard", "gathered"):
            t = Training(global_batch=8, micro_batch=b, seq_len=s, dtype=dtype, sp_saved_inputs=saved)
            key = saved + ("-bf16" if dtype == "bf16" else "")
            counted[key] = sum(
                cfg.activation_bytes(i, b, s, tp=2, sequence_parallel=True, bytes_per_element=4 if dtype == "fp32" else 2)
                + runtime_held_bytes(cfg, t, 1, i, "none", b, s, 2, True, cpu=True, matmul_params=(
                    layer_params_on_device(cfg, i, 2) - replicated_params(cfg, cfg.layer_kind(i)) if i else 0.0))
                for i in range(cfg.num_layers_total))
            assert band[0] <= counted[key] / got[key] <= band[1], (key, counted[key] / got[key])
    spared = got["gathered"] - got["shard"]
    assert 0.85 <= (counted["gathered"] - counted["shard"]) / spared <= 1.1


@pytest.mark.parametrize("limit", [3.0, 3.5])
def test_the_search_prices_either_mode_as_the_estimate_does(limit):
    """`trident search --sp-saved-inputs gathered`: the search, with every plan keeping its gathered
    inputs, returns the fastest such plan that fits (exhaustive enumeration agrees), slower than
    keeping shards where memory binds (3 GiB) and faster where it does not (3.5 GiB; 4 until the
    optimizer's temporaries went, session 50); `either`
    returns the fastest plans of both modes and of no SP."""
    from test_search import A100, GiB, SearchSpace, check_same, plan_level, shrunk
    space = SearchSpace(tp=(2, 4), sequence_parallel=(True,), zero=(0,), zero_per_stage=False,
                        recompute=("none", "full"), recompute_granularity="plan", schedules=("1f1b", "gpipe"))
    model, cluster = shrunk(4, hidden=2048), A100.shaped_as(1, 4)
    found = {saved: check_same(model, cluster, 8, 1024, limit * GiB, space, plan_level((0,), ("none", "full")),
                               sp_saved_inputs=saved) for saved in ("shard", "gathered")}
    assert all(f.plan.training.sp_saved_inputs == saved for saved, f in found.items())
    faster = found["gathered"].estimate.step_time_s < found["shard"].estimate.step_time_s
    assert faster == (limit == 3.5)
    # --sp-saved-inputs either (planner.sp_modes): the faster of the two, with SP off searched too
    with_off = dataclasses.replace(space, sequence_parallel=(False, True))
    both = search_either(partial(search, model, cluster), space=with_off, top=2, global_batch=8, seq_len=1024,
                         memory_limit_bytes=limit * GiB)
    alone = {saved: search(model, cluster, 8, 1024, limit * GiB, space=space, top=2, sp_saved_inputs=saved)
             for saved in ("shard", "gathered")}
    off = search(model, cluster, 8, 1024, limit * GiB, top=2,
                 space=dataclasses.replace(space, sequence_parallel=(False,)))
    times = sorted(f.estimate.step_time_s for r in (*alone.values(), off) for f in r.results)
    assert [f.estimate.step_time_s for f in both.results] == times[:2]
    assert both.best.plan.training.sp_saved_inputs == ("gathered" if faster else "shard")
