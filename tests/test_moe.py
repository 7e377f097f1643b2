"""Mixture-of-experts models (planner.moe, runtime.moe): their specification, parameter counts
against the released models, FLOPs, activations, what the runtime's block keeps and moves against
what the planner counts, and MoE plans training alike under every parallelism."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from planner.build import build_plan
from planner.cluster import load_cluster
from planner.cost import estimate
from planner.hf_config import from_hf_config
from planner.model import ConfigError, ModelConfig
from planner.moe import MoESpec, routing_bytes
from planner.plan import Plan
from planner.pointwise import eager_bytes
from planner.zoo import ZOO

H100 = load_cluster("dgx-h100-80gb")
MIXTRAL_HF = {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
              "num_key_value_heads": 8, "num_hidden_layers": 32, "num_local_experts": 8, "num_experts_per_tok": 2,
              "vocab_size": 32000, "max_position_embeddings": 32768, "rope_theta": 1e6, "rms_norm_eps": 1e-5,
              "tie_word_embeddings": False, "sliding_window": None}
QWEN15_MOE_HF = {"model_type": "qwen2_moe", "hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 16,
                 "num_key_value_heads": 16, "num_hidden_layers": 24, "vocab_size": 151936,
                 "max_position_embeddings": 8192, "rope_theta": 1e6, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                 "decoder_sparse_step": 1, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
                 "num_experts_per_tok": 4, "num_experts": 60, "norm_topk_prob": False}
QWEN3_MOE_HF = {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
                "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_hidden_layers": 48,
                "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 151936, "max_position_embeddings": 40960,
                "rope_theta": 1e6, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "decoder_sparse_step": 1,
                "mlp_only_layers": [], "norm_topk_prob": True}


def test_parameter_counts_match_the_released_models():
    # Mixtral 8x7B: 46,702,792,704 parameters (its safetensors index: 93,405,585,408 bytes in bf16);
    # "47B parameters, 13B active" (Jiang et al. 2024, section 2.1)
    mixtral = ZOO["mixtral-8x7b"]
    assert mixtral.num_parameters() == 46_702_792_704
    assert mixtral.active_parameters() == pytest.approx(12.9e9, rel=0.01)
    # Mixtral 8x22B: 141B, 39B active (Mistral AI's announcement)
    assert ZOO["mixtral-8x22b"].num_parameters() == pytest.approx(141e9, rel=0.01)
    assert ZOO["mixtral-8x22b"].active_parameters() == pytest.approx(39e9, rel=0.01)
    # Qwen3-30B-A3B: 30.5B, 3.3B activated (its model card); 30,532,122,624 in transformers'
    # Qwen3MoeForCausalLM of its config, the per-head q and k norms (qk_norm) included
    qwen3 = ZOO["qwen3-30b-a3b"]
    assert qwen3.num_parameters() == 30_532_122_624 and qwen3.qk_norm
    assert qwen3.active_parameters() == pytest.approx(3.3e9, rel=0.02)
    # Qwen3-235B-A22B: 235B, 22B activated (its model card); transformers' count of its config
    assert ZOO["qwen3-235b-a22b"].num_parameters() == 235_093_634_560
    assert ZOO["qwen3-235b-a22b"].active_parameters() == pytest.approx(22e9, rel=0.01)
    # Qwen1.5-MoE-A2.7B: 14.3B, 2.7B activated (its model card), a shared expert with its gate
    qwen15 = from_hf_config(QWEN15_MOE_HF, name="qwen1.5-moe-a2.7b")
    assert qwen15.num_parameters() == pytest.approx(14.3e9, rel=0.01)
    assert qwen15.active_parameters() == pytest.approx(2.7e9, rel=0.01)
    # a dense model's are all active
    assert ZOO["llama3-8b"].active_parameters() == ZOO["llama3-8b"].num_parameters()


def test_hugging_face_moe_configs_map_to_the_zoo():
    assert from_hf_config(MIXTRAL_HF, name="mixtral-8x7b") == ZOO["mixtral-8x7b"]
    assert from_hf_config(QWEN3_MOE_HF, name="qwen3-30b-a3b") == ZOO["qwen3-30b-a3b"]
    qwen15 = from_hf_config(QWEN15_MOE_HF)
    assert qwen15.moe == MoESpec(60, 4, 5632, normalize_top_k=False) and qwen15.ffn_hidden == 1408 and qwen15.qkv_bias
    for key, value in (("decoder_sparse_step", 2), ("mlp_only_layers", [0, 1])):
        with pytest.raises(ConfigError, match=key):
            from_hf_config({**QWEN3_MOE_HF, key: value})
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        from_hf_config({**QWEN3_MOE_HF, "num_experts_per_tok": 0})


def test_bad_moe_fields_are_one_line_naming_the_field():
    base = ZOO["tiny"].to_dict()
    for moe, field in (({"experts": 4, "experts_per_token": 5}, "model.moe.experts_per_token"),
                       ({"experts": 1, "experts_per_token": 1}, "model.moe.experts"),
                       ({"experts": 4, "experts_per_token": 2, "shared_ffn_hidden": -1}, "model.moe.shared_ffn_hidden"),
                       ({"experts": 4, "experts_per_token": 2, "capacity": 1.0}, "model.moe.capacity"),
                       ([4, 2], "model.moe")):
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")) as err:
            ModelConfig.from_dict({**base, "moe": moe})
        assert "\n" not in str(err.value)
    gpt = ZOO["tiny-gpt"].to_dict()
    with pytest.raises(ConfigError, match="model.moe: .*arch llama"):
        ModelConfig.from_dict({**gpt, "moe": {"experts": 4, "experts_per_token": 2}})


def test_flops_count_the_router_and_k_experts():
    m = ZOO["mixtral-8x7b"]
    dense = dataclasses.replace(m, name="k-wide", ffn_hidden=2 * m.ffn_hidden, moe=None)
    b, s = 2, 4096
    # a token's products: attention, the router (hidden x experts) and k experts' SwiGLU
    assert m.layer_forward_flops(1, b, s) - dense.layer_forward_flops(1, b, s) == 2.0 * b * s * m.hidden * 8
    for tp in (1, 2, 8):
        ffn = [g for g in m.block_gemms(b, s, tp)[2:-2]]
        got = sum(2.0 * c * M * N * K for c, M, N, K in ffn)
        assert got == pytest.approx(2.0 * b * s * (3 * 2 * m.hidden * m.ffn_hidden / tp + m.hidden * 8))
        assert ffn[0][:2] == (16, b * s * 2 / 8)  # gate and up of 8 experts, balanced: tokens x k / experts rows
    # the model FLOPs (MFU) of a step: of the active parameters
    plan = build_plan(m, cluster_name=H100.name, device=H100.device.name, nodes=2, devices_per_node=8,
                      global_batch=16, micro_batch=1, seq_len=s, tp=8, zero=3, recompute="full")
    est = estimate(plan, H100)
    assert est.active_parameters == m.active_parameters() and est.to_dict()["active_parameters"] < est.parameters
    flops = est.model_tflops_per_gpu * 1e12 * est.step_time_s * 16
    assert flops == pytest.approx(m.model_flops_per_step(16, s), rel=1e-9)  # recomputation not counted
    # Megatron-LM's count (num_floating_point_operations, megatron/training/training.py at core_r0.8.0):
    # 12 B s L h^2 ((1 + g / a + s / h) + (f / h) k 3 / 2 + V / (2 L h)), the router left out
    h, f, L, V, B = m.hidden, m.ffn_hidden, m.layers, m.vocab, 256
    megatron = 12 * B * s * L * h * h * ((1 + m.kv_heads / m.heads + s / h) + f / h * 2 * 1.5 + V / (2 * L * h))
    router = 6 * B * s * L * h * 8
    assert m.model_flops_per_step(B, s) == pytest.approx(megatron + router, rel=1e-12)


def test_activations_keep_k_rows_and_the_routing_whole_on_each_tp_rank():
    m = dataclasses.replace(ZOO["tiny"], name="tiny-moe", moe=MoESpec(8, 2))
    dense = dataclasses.replace(m, name="tiny", moe=None)
    b, s, e, h, f = 2, 64, 2, m.hidden, m.ffn_hidden
    for tp, sp in ((1, False), (2, False), (4, True)):
        kw = dict(micro_batch=b, seq_len=s, tp=tp, sequence_parallel=sp, bytes_per_element=e)
        extra = m.activation_bytes(1, **kw) - dense.activation_bytes(1, **kw)
        # SwiGLU's 4 ffn of each of k rows, split tp ways; whole on every TP rank: float32 router
        # probabilities, int64 top-k indices, float32 top-k probabilities and their sum, the rows'
        # tokens and order (int64), the rows the experts read, their outputs, weights and weighted outputs
        k = 2
        assert extra == pytest.approx(b * s * (4 * e * (k - 1) * f / tp + 4 * 8 + (8 + 4) * k + 4 + 2 * 8 * k
                                               + e * k + 3 * e * k * h))
        assert m.activation_bytes(1, recompute="full", **kw) == dense.activation_bytes(1, recompute="full", **kw)
    # the eager routing moves the same bytes on every TP rank; the SwiGLU's k rows split
    wide = dataclasses.replace(dense, ffn_hidden=2 * f)
    for tp in (1, 2):
        fm, bm = eager_bytes(m, 1, b, s, tp, False, e, False, "flash")
        fd, bd = eager_bytes(wide, 1, b, s, tp, False, e, False, "flash")
        assert (fm - fd, bm - bd) == pytest.approx(tuple(b * s * x for x in routing_bytes(m, e)))


def test_moe_plans_round_trip_and_dense_ones_read_as_before(tmp_path):
    m = ZOO["qwen3-30b-a3b"]
    plan = build_plan(m, cluster_name=H100.name, device=H100.device.name, nodes=1, devices_per_node=8,
                      global_batch=16, micro_batch=1, seq_len=4096, tp=2, pp=2, zero=1)
    a = tmp_path / "a.json"
    plan.write(a)
    assert json.loads(a.read_text())["model"]["moe"] == {"experts": 128, "experts_per_token": 8, "shared_ffn_hidden": 0,
                                                         "normalize_top_k": True}
    back = Plan.read(a)
    assert back.model == m
    back.write(tmp_path / "b.json")
    assert (tmp_path / "b.json").read_bytes() == a.read_bytes()
    assert "moe" not in ZOO["llama3-8b"].to_dict()


def test_the_balancing_loss_is_a_checked_training_field_left_out_at_zero(tmp_path):
    kw = dict(cluster_name=H100.name, device=H100.device.name, nodes=1, devices_per_node=8, global_batch=16,
              micro_batch=1, seq_len=4096)
    for model, value, says in ((ZOO["llama3-8b"], 0.01, "is for mixture-of-experts models"),
                               (ZOO["mixtral-8x7b"], 2.0, "must be a number from 0 to 1")):
        with pytest.raises(ConfigError, match=rf"training\.moe_aux_loss: .*{says}"):
            build_plan(model, moe_aux_loss=value, **kw)
    plain = build_plan(ZOO["mixtral-8x7b"], tp=8, **kw)
    assert "moe_aux_loss" not in plain.to_dict()["training"]
    balanced = build_plan(ZOO["mixtral-8x7b"], tp=8, moe_aux_loss=0.01, **kw)
    assert balanced.to_dict()["training"]["moe_aux_loss"] == 0.01
    assert estimate(balanced, H100).step_time_s == estimate(plain, H100).step_time_s  # not priced: a few bytes


def test_tp_must_divide_the_shared_expert_too():
    m = ModelConfig.from_dict({**ZOO["tiny"].to_dict(), "name": "shared", "moe": {"experts": 4, "experts_per_token": 2,
                                                                                   "shared_ffn_hidden": 6}})
    assert ("moe.shared_ffn_hidden", 6) in m.tp_split_sizes()
    with pytest.raises(ConfigError, match=r"model\.moe\.shared_ffn_hidden=6"):
        build_plan(m, cluster_name=H100.name, device=H100.device.name, nodes=1, devices_per_node=4,
                   global_batch=4, micro_batch=1, seq_len=64, tp=4)


TINY_MOE = dataclasses.replace(ZOO["tiny"], name="tiny-moe", moe=MoESpec(4, 2, 64))


@pytest.mark.parametrize("moe", [MoESpec(8, 2), MoESpec(16, 4), MoESpec(4, 1, 256), MoESpec(8, 2, 256, False)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_runtime_moe_block_keeps_and_moves_what_the_planner_counts(moe, dtype):
    """What runtime.moe's block saves for its backward (saved-tensor hooks, by storage) and the
    bytes its memory-bound operations move (tests/test_pointwise.py's counter) against
    ModelConfig.activation_bytes and planner.pointwise.eager_bytes: within what a dense block
    of the same shape differs by (the rotary tables' and the norms' few bytes a token)."""
    from test_pointwise import _gpu_norms, _kept_bytes, _small, _traced
    from runtime.model import Block, rope_tables
    b, s, e = 8, 32, torch.tensor([], dtype=dtype).element_size()
    gaps = []
    for cfg in (_small("llama3-8b"), _small("llama3-8b", moe=moe)):
        block = _gpu_norms(Block(cfg).to(dtype), cfg, dtype)
        cos, sin = rope_tables(cfg)
        x = torch.randn(b, s, cfg.hidden, dtype=dtype, requires_grad=True)
        saved = _kept_bytes(block, x, cos, sin)
        fwd, bwd = _traced(lambda t: block(t, cos, sin), x)
        pf, pb = eager_bytes(cfg, 1, b, s, 1, False, e, False, "flash")
        gaps.append((saved - cfg.activation_bytes(1, b, s, bytes_per_element=e, attention="flash"), fwd - pf, bwd - pb))
    dense, moe_gap = gaps
    # the one per-call term the planner's per-token count leaves out: bincount's int64 count per expert
    assert moe_gap == pytest.approx(dense, abs=8 * moe.experts), (moe_gap, dense)
    assert all(0 <= g <= 250 * b * s for g in dense)  # the dense block's own gap: a few bytes a token


@pytest.mark.parametrize("ep", [1, 2, 4])
@pytest.mark.parametrize("moe", [MoESpec(8, 2), MoESpec(16, 4, 64)])
def test_the_expert_parallel_exchange_moves_what_the_planner_counts(moe, ep, monkeypatch):
    """runtime.moe's expert-parallel path (each token to the ranks of its experts, their weighted
    sums back) run on one process as rank 0 of `ep`, its all-to-alls views (communication, priced
    apart): it sends each token to r of the ep ranks and receives those rows back as its own, so
    it moves what a rank of a balanced group moves, its experts computing the rows of all ep ranks'
    (as many rows in all). The bytes its memory-bound operations move beyond the single-process
    block's, traced, against planner.moe.dispatch_bytes at the r of its routing (the int64
    indices, about 35 bytes a row beyond the first, and a few bytes a token per expert left out),
    and what it keeps for the backward beyond the block's, exactly: the sums received back; its
    backward also scales its experts' weight gradients (by 1 / ep: a pass over them)."""
    import torch.distributed.nn.functional as dist_nn
    from runtime import moe as runtime_moe
    from runtime.model import Block, rope_tables
    from test_pointwise import _gpu_norms, _kept_bytes, _small, _traced
    from planner.moe import dispatch_bytes
    sent = []  # the rows each exchange of counts announces

    def counts(out, inp, group=None):
        sent.append(int(inp.sum()))
        return out.copy_(inp)
    monkeypatch.setattr(runtime_moe.dist, "all_to_all_single", counts)
    monkeypatch.setattr(dist_nn, "all_to_all_single", lambda out, inp, out_splits, in_splits, group: inp.view_as(inp))
    cfg, dtype, b, s = _small("llama3-8b", moe=moe), torch.bfloat16, 8, 32
    cos, sin = rope_tables(cfg)
    got = []
    for spread in (False, True):
        torch.manual_seed(0)
        block = _gpu_norms(Block(cfg).to(dtype), cfg, dtype)
        if spread:
            block.feed_forward.ep = (None, ep, 0)
        x = torch.randn(b, s, cfg.hidden, dtype=dtype, requires_grad=True)
        got.append((_kept_bytes(block, x, cos, sin), *_traced(lambda t: block(t, cos, sin), x)))
    (kept0, f0, b0), (kept1, f1, b1) = got
    tokens = b * s
    r = sent[-1] / tokens
    assert (r == 1) == (ep == 1) and 1 <= r <= min(ep, moe.experts_per_token)
    want_f, want_b, want_kept = dispatch_bytes(cfg, 2, ep, ranks=r)
    assert kept1 - kept0 == want_kept * tokens
    left_out = 24 * moe.experts + 40 * (r - 1)
    assert 0 <= (f1 - f0) / tokens - want_f <= left_out, ((f1 - f0) / tokens, want_f)
    scaled = 2 * 2 * moe.experts // ep * 3 * cfg.hidden * cfg.ffn_hidden  # its experts' weight gradients times 1 / ep
    assert 0 <= (b1 - b0 - scaled) / tokens - want_b <= left_out, ((b1 - b0 - scaled) / tokens, want_b)


def test_moe_plans_train_like_one_process_and_fit_their_prediction(tmp_path):
    """Tiny with 4 experts (2 a token), a shared expert, Qwen3's per-head q and k norms (their
    weights' gradients partial sums over the TP group too) and the load-balancing loss: tensor
    parallelism with sequence parallelism (the experts split by columns, the routing weights'
    gradients partial sums), ZeRO 3 with full recomputation, 1F1B, ZB-V and interleaved pipelines,
    FSDP2 over TP DTensors and expert parallelism (the experts over 2 dp ranks: alone under ZeRO 3,
    with TP and SP, in a pipeline under ZeRO 2, under HSDP over a replica's 2 shards) train with the
    losses and gradient norms of one
    process (the same micro-batches:
    the balancing loss is a micro-batch's); every rank's peak memory is within the CPU heap's
    spread of its prediction (benchmarks/moe_memory.py measures more). Without the balancing loss
    the gradients differ from the first step."""
    from planner.plan import Plan
    from torchrun_helpers import assert_ok, assert_same_losses, train, write_plan
    from benchmarks.zero_memory import UNDER
    kw, qwen3 = dict(moe_aux_loss=0.1), dataclasses.replace(TINY_MOE, qk_norm=True)
    refs = [write_plan(tmp_path, "ref", qwen3, **kw), write_plan(tmp_path, "ref-no-aux", qwen3)]
    two = [write_plan(tmp_path, "tp2-sp", qwen3, world=2, tp=2, sequence_parallel=True, recompute="selective", **kw),
           write_plan(tmp_path, "dp2-zero3-full", qwen3, world=2, zero=3, recompute="full", **kw),
           write_plan(tmp_path, "pp2-1f1b", qwen3, world=2, pp=2, schedule="1f1b", **kw),
           write_plan(tmp_path, "pp2-zbv", qwen3, world=2, pp=2, schedule="zbv", recompute="selective", **kw),
           write_plan(tmp_path, "pp2-interleaved", qwen3, world=2, pp=2, schedule="interleaved-1f1b",
                      virtual_stages=2, **kw)]
    two.append(write_plan(tmp_path, "dp2-ep2-zero3-full", qwen3, world=2, zero=3, recompute="full", ep=2, **kw))
    four = [write_plan(tmp_path, "dp2-tp2-sp", qwen3, world=4, tp=2, zero=1, sequence_parallel=True, **kw),
            write_plan(tmp_path, "dp2-tp2-ep2-sp", qwen3, world=4, tp=2, zero=1, ep=2, sequence_parallel=True, **kw),
            write_plan(tmp_path, "pp2-dp2-ep2-zero2", qwen3, world=4, pp=2, zero=2, ep=2, **kw),
            write_plan(tmp_path, "hsdp2x2-ep2", qwen3, world=4, dp_replicate=2, zero=3, ep=2, **kw)]
    out = tmp_path / "runs"
    assert_ok(train(1, "--plan", *refs, "--steps", 4, "--out", out))
    assert_ok(train(2, "--plan", *two, "--steps", 4, "--out", out))
    assert_ok(train(4, "--plan", *four, "--steps", 4, "--out", out))
    want = json.loads((out / "ref.json").read_text())
    plain = json.loads((out / "ref-no-aux.json").read_text())
    # the balancing loss is left out of the loss reported; its gradient is in the norm, 10x the tolerance
    assert plain["losses"][0] == want["losses"][0] and plain["losses"][1] != want["losses"][1]
    assert abs(plain["grad_norms"][0] - want["grad_norms"][0]) > 1e-3 * want["grad_norms"][0]
    # its value, a figure of its own (1: uniform routing, 2: n / k), recorded once a micro-batch's
    # backward (not for full recomputation's replays nor a pipeline's shape inference), the same
    # under every plan
    assert plain["moe_balance"] is None and len(want["moe_balance"]) == 4
    assert all(1.0 < b < 2.0 for b in want["moe_balance"]), want["moe_balance"]
    # the busiest expert's rows over the mean a forward (runtime.moe.RoutingMeter; at most n / k):
    # recorded with the balancing loss or without; one rank's micro-batches as one process's, or
    # under expert parallelism the EP group's two micro-batches together, alike under each plan
    assert len(plain["moe_load_factor"]) == 4 and plain["moe_load_factor"][0] == want["moe_load_factor"][0]
    assert all(1.0 < x <= 2.0 for x in want["moe_load_factor"]), want["moe_load_factor"]
    over_ep = {}
    for path in [*two, *four]:
        run = json.loads((out / path.name).read_text())
        assert_same_losses(run["losses"], want["losses"], path.stem)
        assert_same_losses(run["grad_norms"], want["grad_norms"], f"{path.stem} gradient norm")
        assert_same_losses(run["moe_balance"], want["moe_balance"], f"{path.stem} balancing loss")
        plan = Plan.read(path)  # under expert parallelism an EP group's micro-batches, alike at a dp degree
        loads = over_ep.setdefault(plan.mesh.dp, run["moe_load_factor"]) if plan.mesh.ep > 1 else want["moe_load_factor"]
        assert_same_losses(run["moe_load_factor"], loads, f"{path.stem} load factor")
        assert all(1.0 <= x <= 2.0 for x in run["moe_load_factor"])
        # the busiest EP rank's rows (its 2 experts together) over the mean: at most its busiest expert's
        ranks = run["moe_rank_load_factor"]
        assert (ranks is None) == (plan.mesh.ep == 1), path.stem
        assert ranks is None or all(1.0 <= r <= x for r, x in zip(ranks, run["moe_load_factor"])), (path.stem, ranks)
        cluster = dataclasses.replace(load_cluster("dgx-a100-80gb").shaped_as(1, plan.mesh.world_size), backend="gloo")
        per_pp = estimate(plan, cluster).breakdown["memory_per_pp_rank"]
        for r, measured in enumerate(run["peak_memory_bytes_per_rank"]):
            ratio = measured / per_pp[plan.mesh.coords(r)["pp"]]
            # ZeRO 2 and 3 are over-predicted on this machine (README, known gaps), more so under
            # expert parallelism, whose experts FSDP2 gathers apart: pp2-dp2-ep2-zero2 0.83-0.86
            assert 0.78 <= ratio <= UNDER, (path.stem, r, ratio)


def test_the_balancing_loss_gradient_is_that_of_the_loss_it_adds(monkeypatch):
    """runtime.moe.AuxLoss hands the backward `scale` times the balancing loss's gradient: the
    same gradients as that loss, times the coefficient, added to the main one."""
    from runtime import moe
    from runtime.model import init_weights, Transformer
    torch.manual_seed(0)
    ids = torch.randint(0, TINY_MOE.vocab, (2, 32))
    grads = []
    for explicit in (False, True):
        model = Transformer(TINY_MOE)
        init_weights(model, 0)
        caught = []
        if explicit:  # the loss as a loss: AuxLoss hands it over untouched
            monkeypatch.setattr(moe.AuxLoss, "apply", lambda out, aux, scale, seen: caught.append(aux) or out)
        for module in model.modules():
            if isinstance(module, moe.MoEFeedForward):
                module.aux_scale = lambda: 0.3
        loss = model(ids).float().logsumexp(-1).mean()
        (loss + 0.3 * sum(caught) if explicit else loss).backward()
        assert len(caught) == (TINY_MOE.layers if explicit else 0)
        grads.append([p.grad.clone() for p in model.parameters()])
    for g, want in zip(*grads):
        assert torch.allclose(g, want, rtol=1e-5, atol=1e-8)
    monkeypatch.undo()
    router = model.layers["1"].feed_forward.router.weight.grad
    assert router.abs().max() > 0


def test_a_model_profile_of_moe_blocks_prices_plans_with_and_without_expert_parallelism(cluster_profile):
    """`trident profile model` measures MoE blocks as the runtime runs them (its loop over the
    experts, balanced routing as random weights give it); a plan priced from the profile holds the
    experts it measured, and under expert parallelism experts / ep of them, with the all-to-alls and
    the data-parallel collectives priced as the analytic model prices them."""
    from planner.model_profile import load_model_profile
    from torchrun_helpers import profile_ranks
    model, out = cluster_profile.parent / "tiny-moe.model.json", cluster_profile.parent / "tiny-moe.json"
    model.write_text(json.dumps(TINY_MOE.to_dict()))
    proc = profile_ranks(1, "model", "--model", model, "--cluster-profile", cluster_profile, "--seq-len", 32,
                         "--micro-batches", "1,2", "--tp", "1", "--repeats", 3, "-o", out)
    assert proc.returncode == 0, proc.stderr[-4000:]
    mp = load_model_profile(str(out))
    cluster = load_cluster(str(cluster_profile))
    kw = dict(cluster_name=cluster.name, device=cluster.device.name, nodes=1, global_batch=4, micro_batch=2,
              seq_len=32, dtype="fp32")
    one, cl1 = build_plan(TINY_MOE, devices_per_node=1, **kw), cluster.shaped_as(1, 1)
    measured, analytic = estimate(one, cl1, model_profile=mp), estimate(one, cl1)
    assert measured.step_time_s > 0 and measured.stages[0]["params"] == pytest.approx(analytic.stages[0]["params"])
    cl2 = cluster.shaped_as(1, 2)
    for ep in (1, 2):
        plan = build_plan(TINY_MOE, devices_per_node=2, zero=1, ep=ep, **kw)
        est, ana = estimate(plan, cl2, model_profile=mp), estimate(plan, cl2)
        assert est.stages[0]["params"] == pytest.approx(ana.stages[0]["params"])  # 2 of the 4 experts under ep 2
        assert (est.breakdown["time"].get("ep_comm_s", 0.0) > 0) == (ep == 2)
        assert est.breakdown["time"].get("ep_comm_s") == pytest.approx(ana.breakdown["time"].get("ep_comm_s"))
    experts = 3 * TINY_MOE.hidden * TINY_MOE.ffn_hidden * TINY_MOE.layers  # of one expert, in every block
    assert est.stages[0]["params"] == pytest.approx(measured.stages[0]["params"] - 2 * experts)
    # a busiest expert at 1.5x the mean (measured about even) adds what it adds to the analytic model
    busy = build_plan(TINY_MOE, devices_per_node=2, zero=1, ep=2, moe_load_factor=1.5, **kw)
    more = [estimate(busy, cl2, model_profile=p).step_time_s - e.step_time_s for p, e in ((mp, est), (None, ana))]
    assert more[0] > 0 and more[0] == pytest.approx(more[1], rel=0.05)
    # the search prices expert-parallel configurations from the profile too (planner.search)
    from planner.search import SearchSpace, search_profiled
    found = search_profiled(TINY_MOE, cl2, mp, global_batch=4, seq_len=32, dtype="fp32", top=3,
                            space=SearchSpace(ep=(2,)))
    assert found.results and all(f.plan.mesh.ep == 2 for f in found.results)
    for f in found.results:
        assert f.estimate.step_time_s == estimate(f.plan, cl2, model_profile=mp).step_time_s


def test_what_the_runtime_cannot_do_with_moe_models_is_one_line(tmp_path):
    """`trident export` writes Mixtral, Qwen2-MoE and Qwen3-MoE models, not one none computes: it
    says so in one line."""
    from runtime.checkpoint import META
    from runtime.export import export
    step = tmp_path / "ckpt" / "step-1"
    step.mkdir(parents=True)
    (step / META).write_text(json.dumps({"step": 1, "run": {"model": TINY_MOE.to_dict(), "training": {}}}))
    with pytest.raises(ConfigError, match="tiny-moe: a shared expert without q/k/v biases: no transformers MoE") as err:
        export(step, tmp_path / "out", "fp32", 1e9, False, None)
    assert "\n" not in str(err.value)
