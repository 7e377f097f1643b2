"""Mixture-of-experts models (planner.moe): their specification, parameter counts against the
released models, FLOPs, activations and the plans priced with them."""
from __future__ import annotations

import dataclasses
import json

import pytest

from planner.build import build_plan
from planner.cluster import load_cluster
from planner.cost import estimate
from planner.hf_config import from_hf_config
from planner.model import ZOO, ConfigError, ModelConfig
from planner.moe import MoESpec, routing_bytes
from planner.plan import Plan
from planner.pointwise import eager_bytes

H100 = load_cluster("dgx-h100-80gb")
MIXTRAL_HF = {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
              "num_key_value_heads": 8, "num_hidden_layers": 32, "num_local_experts": 8, "num_experts_per_tok": 2,
              "vocab_size": 32000, "max_position_embeddings": 32768, "rope_theta": 1e6, "rms_norm_eps": 1e-5,
              "tie_word_embeddings": False, "sliding_window": None}
QWEN15_MOE_HF = {"model_type": "qwen2_moe", "hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 16,
                 "num_key_value_heads": 16, "num_hidden_layers": 24, "vocab_size": 151936,
                 "max_position_embeddings": 8192, "rope_theta": 1e6, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                 "decoder_sparse_step": 1, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
                 "num_experts_per_tok": 4, "num_experts": 60}
QWEN3_MOE_HF = {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
                "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_hidden_layers": 48,
                "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 151936, "max_position_embeddings": 40960,
                "rope_theta": 1e6, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "decoder_sparse_step": 1,
                "mlp_only_layers": []}


def test_parameter_counts_match_the_released_models():
    # Mixtral 8x7B: 46,702,792,704 parameters (its safetensors index: 93,405,585,408 bytes in bf16);
    # "47B parameters, 13B active" (Jiang et al. 2024, section 2.1)
    mixtral = ZOO["mixtral-8x7b"]
    assert mixtral.num_parameters() == 46_702_792_704
    assert mixtral.active_parameters() == pytest.approx(12.9e9, rel=0.01)
    # Mixtral 8x22B: 141B, 39B active (Mistral AI's announcement)
    assert ZOO["mixtral-8x22b"].num_parameters() == pytest.approx(141e9, rel=0.01)
    assert ZOO["mixtral-8x22b"].active_parameters() == pytest.approx(39e9, rel=0.01)
    # Qwen3-30B-A3B: 30.5B, 3.3B activated (its model card); 30,532,122,624 with the q and k
    # norms left out here (48 blocks x 2 x 128)
    qwen3 = ZOO["qwen3-30b-a3b"]
    assert qwen3.num_parameters() == 30_532_122_624 - 48 * 2 * 128
    assert qwen3.active_parameters() == pytest.approx(3.3e9, rel=0.02)
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
    assert qwen15.moe == MoESpec(60, 4, 5632) and qwen15.ffn_hidden == 1408 and qwen15.qkv_bias
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


def test_activations_keep_k_rows_and_the_routing_whole_on_each_tp_rank():
    m = dataclasses.replace(ZOO["tiny"], name="tiny-moe", moe=MoESpec(8, 2))
    dense = dataclasses.replace(m, name="tiny", moe=None)
    b, s, e, h, f = 2, 64, 2, m.hidden, m.ffn_hidden
    for tp, sp in ((1, False), (2, False), (4, True)):
        kw = dict(micro_batch=b, seq_len=s, tp=tp, sequence_parallel=sp, bytes_per_element=e)
        extra = m.activation_bytes(1, **kw) - dense.activation_bytes(1, **kw)
        # SwiGLU's 4 ffn of each of k rows, split tp ways; whole on every TP rank: float32 router
        # probabilities, int64 indices and float32 top-k probabilities and weights, the rows the
        # experts read and their outputs
        assert extra == pytest.approx(b * s * (4 * e * (2 - 1) * f / tp + 4 * 8 + 16 * 2 + 2 * e * 2 * h))
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
    assert json.loads(a.read_text())["model"]["moe"] == {"experts": 128, "experts_per_token": 8, "shared_ffn_hidden": 0}
    back = Plan.read(a)
    assert back.model == m
    back.write(tmp_path / "b.json")
    assert (tmp_path / "b.json").read_bytes() == a.read_bytes()
    assert "moe" not in ZOO["llama3-8b"].to_dict()


def test_tp_must_divide_the_shared_expert_too():
    m = ModelConfig.from_dict({**ZOO["tiny"].to_dict(), "name": "shared", "moe": {"experts": 4, "experts_per_token": 2,
                                                                                   "shared_ffn_hidden": 6}})
    assert ("moe.shared_ffn_hidden", 6) in m.tp_split_sizes()
    with pytest.raises(ConfigError, match=r"model\.moe\.shared_ffn_hidden=6"):
        build_plan(m, cluster_name=H100.name, device=H100.device.name, nodes=1, devices_per_node=4,
                   global_batch=4, micro_batch=1, seq_len=64, tp=4)


def test_the_runtime_refuses_moe_plans_and_models_in_one_line(tmp_path, capsys, monkeypatch):
    """Trident's runtime has no MoE block yet: `trident run` and `trident profile model` say so by
    the field, before any process group."""
    from runtime.profile import parse_args
    from runtime.profile_model import check_args
    from runtime.train import main as train_main
    from tests.torchrun_helpers import write_plan
    monkeypatch.setenv("WORLD_SIZE", "1")
    tiny_moe = dataclasses.replace(ZOO["tiny"], name="tiny-moe", moe=MoESpec(4, 2))
    assert train_main(["--plan", str(write_plan(tmp_path, "moe", tiny_moe))]) == 2
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("trident: error:")]
    assert len(lines) == 1 and "model.moe: the runtime trains dense models" in lines[0], lines
    (tmp_path / "moe.model.json").write_text(json.dumps(tiny_moe.to_dict()))
    with pytest.raises(ConfigError, match="--model: tiny-moe has mixture-of-experts blocks"):
        check_args(parse_args(["model", "--model", str(tmp_path / "moe.model.json"), "--cluster-profile",
                               "dgx-a100-80gb", "--seq-len", "32", "-o", "m.json"]), 1)
