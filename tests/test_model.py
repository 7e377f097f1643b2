"""Model specification: parameter counts, FLOPs and activation formulas against their sources."""
import dataclasses
import json

import pytest

from planner.hf_config import from_hf_config
from planner.model import ConfigError, ModelConfig
from planner.model_files import load_model
from planner.zoo import ZOO


@pytest.mark.parametrize("name,published", [
    ("gpt3-175b", 175e9), ("llama2-7b", 6.74e9), ("llama2-13b", 13.0e9), ("llama2-70b", 68.98e9),
    ("llama3-8b", 8.03e9), ("llama3-70b", 70.55e9), ("llama3-405b", 405.85e9),
])
def test_parameter_counts_match_known_models_within_one_percent(name, published):
    assert abs(ZOO[name].num_parameters() / published - 1) < 0.01


def test_published_gpt_rows_have_their_parameter_counts():
    for name, billions in [("gpt-1.7b", 1.7), ("gpt-18.4b", 18.4), ("gpt-145.6b", 145.6), ("gpt-1008b", 1008.0)]:
        assert abs(ZOO[name].num_parameters() / (billions * 1e9) - 1) < 0.05


def test_gpt_block_params_closed_form():
    m = ZOO["gpt3-175b"]
    h = m.hidden
    assert m.block_params() == 12 * h * h + 13 * h  # Narayanan et al. 2021: 12 h^2 + 13 h per layer


def test_tiny_models_run_tp_up_to_four():
    for name in ("tiny", "tiny-gpt"):
        m = ZOO[name]
        for fld in ("heads", "kv_heads", "ffn_hidden"):
            assert getattr(m, fld) % 4 == 0


def test_step_flops_equal_megatron_formula():
    # Narayanan et al. SC'21 eq. 3 (full recompute): 96 B s l h^2 (1 + s/(6h) + V/(16 l h))
    m = ZOO["gpt-18.4b"]
    B, s, l, h, V = 1024, 2048, m.layers, m.hidden, m.vocab
    expected = 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    assert m.model_flops_per_step(B, s, recompute="full") == pytest.approx(expected, rel=1e-12)
    without = 72 * B * s * l * h * h * (1 + s / (6 * h)) + 6 * B * s * h * V
    assert m.model_flops_per_step(B, s) == pytest.approx(without, rel=1e-12)


def test_block_gemms_account_for_every_forward_flop():
    for name in ("gpt3-175b", "llama3-8b", "tiny"):
        m = ZOO[name]
        gemm = sum(2 * c * M * N * K for c, M, N, K in m.block_gemms(2, 512, 1))
        assert gemm == m.layer_forward_flops(1, 2, 512)


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_gpt_activations_match_korthikanti_closed_forms(t):
    # Korthikanti et al. 2022, table 2 (fp16, dropout, unfused attention, ffn = 4h)
    m = ZOO["gpt3-175b"]
    s, b, h, a = 2048, 1, m.hidden, m.heads
    kw = dict(micro_batch=b, seq_len=s, tp=t, dropout=True, attention="unfused")
    none = m.activation_bytes(1, **kw)
    assert none == pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))
    sp = m.activation_bytes(1, sequence_parallel=True, **kw)
    assert sp == pytest.approx(s * b * h / t * (34 + 5 * a * s / h))
    sel = m.activation_bytes(1, sequence_parallel=True, recompute="selective", **kw)
    assert sel == pytest.approx(34 * s * b * h / t)
    full = m.activation_bytes(1, recompute="full", **kw)
    assert full == pytest.approx(2 * s * b * h)


def test_fused_attention_keeps_no_square_scores():
    m = ZOO["llama3-8b"]
    flash = m.activation_bytes(1, 1, 8192, attention="flash")
    unfused = m.activation_bytes(1, 1, 8192, attention="unfused")
    assert unfused - flash > 2 * m.heads * 8192 * 8192 * 0.99


def test_hf_config_mapping(tmp_path):
    llama = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
             "max_position_embeddings": 4096, "tie_word_embeddings": False}
    assert from_hf_config(llama).num_parameters() == ZOO["llama2-7b"].num_parameters()
    mistral = dict(llama, model_type="mistral", intermediate_size=14336, num_key_value_heads=8)
    assert abs(from_hf_config(mistral).num_parameters() / 7.24e9 - 1) < 0.01  # Mistral 7B
    qwen = {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
            "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
            "max_position_embeddings": 32768, "tie_word_embeddings": True}
    assert abs(from_hf_config(qwen).num_parameters() / 494.03e6 - 1) < 0.01  # Qwen2-0.5B
    # Qwen3-8B and -0.6B (head_dim 128 where hidden / heads is 64) and Phi-3-mini, from their
    # config.json files; model cards: 8.2B (6.95B without embeddings), 0.6B (0.44B), 3.8B
    qwen3 = {"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
             "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
             "max_position_embeddings": 40960, "rope_theta": 1000000, "rms_norm_eps": 1e-6,
             "attention_bias": False, "tie_word_embeddings": False}
    q8 = from_hf_config(qwen3)
    # 8,190,735,360 in transformers' Qwen3ForCausalLM of that config: the per-head q and k norms counted
    assert q8.num_parameters() == 8_190_735_360 and q8.qk_norm and not q8.qkv_bias
    assert q8 == dataclasses.replace(ZOO["qwen3-8b"], name=q8.name)
    assert abs(q8.layers * q8.block_params() / 6.95e9 - 1) < 0.01
    q06 = from_hf_config(dict(qwen3, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                              num_attention_heads=16, tie_word_embeddings=True))
    assert q06.dim_per_head == 128 and q06.q_dim == 2048
    assert abs(q06.num_parameters() / 0.596e9 - 1) < 0.01 and abs(q06.layers * q06.block_params() / 0.44e9 - 1) < 0.01
    phi3 = {"model_type": "phi3", "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32064,
            "max_position_embeddings": 4096, "tie_word_embeddings": False}
    assert abs(from_hf_config(phi3).num_parameters() / 3.82e9 - 1) < 0.01
    # Gemma 7B and 2B, Gemma 2 9B, 2B and 27B (head_dim 256, or 128 for 27B; embedding and head tied
    # unless the file says otherwise); model cards: 8.54B, 2.51B, 9.24B, 2.61B, 27.2B
    gemma = {"model_type": "gemma", "hidden_size": 3072, "intermediate_size": 24576, "num_hidden_layers": 28,
             "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 256, "vocab_size": 256000}
    gemma2 = dict(gemma, model_type="gemma2", hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
                  num_key_value_heads=8)
    for cfg, card in ((gemma, 8.54e9), (dict(gemma, hidden_size=2048, intermediate_size=16384, num_hidden_layers=18,
                                              num_attention_heads=8, num_key_value_heads=1), 2.51e9),
                      (gemma2, 9.24e9), (dict(gemma2, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                                              num_attention_heads=8, num_key_value_heads=4), 2.61e9),
                      (dict(gemma2, hidden_size=4608, intermediate_size=36864, num_hidden_layers=46,
                            num_attention_heads=32, num_key_value_heads=16, head_dim=128), 27.2e9)):
        g = from_hf_config(cfg)
        assert abs(g.num_parameters() / card - 1) < 0.01 and g.tie_embeddings and g.arch == "llama", cfg
        assert (g.seq_len, g.norm_eps) == (8192, 1e-6)
    assert not from_hf_config(dict(gemma, tie_word_embeddings=False)).tie_embeddings
    gpt2 = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257,
            "n_positions": 1024}
    assert from_hf_config(gpt2).num_parameters() == 124439808  # GPT-2 small
    # a norm epsilon the file leaves out takes transformers' default for the model type
    assert [from_hf_config(c).norm_eps for c in (llama, mistral, qwen, phi3, gpt2)] == [1e-6, 1e-6, 1e-6, 1e-5, 1e-5]
    assert from_hf_config(dict(llama, rms_norm_eps=1e-5)).norm_eps == 1e-5
    # so does a missing context length (max_position_embeddings, GPT-2's n_positions)
    drop = lambda c: {k: v for k, v in c.items() if k not in ("max_position_embeddings", "n_positions")}  # noqa: E731
    assert [from_hf_config(drop(c)).seq_len for c in (llama, mistral, qwen, qwen3, phi3, gpt2)] == \
        [2048, 131072, 32768, 32768, 4096, 1024]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(gpt2))
    assert load_model(str(path)).arch == "gpt"


def test_model_json_file_and_bad_fields(tmp_path):
    good = ZOO["tiny"].to_dict()
    (tmp_path / "m.json").write_text(json.dumps(good))
    assert load_model(str(tmp_path / "m.json")) == ZOO["tiny"]
    (tmp_path / "bad.json").write_text(json.dumps({**good, "hiden": 3}))
    with pytest.raises(ConfigError, match="hiden"):
        load_model(str(tmp_path / "bad.json"))
    with pytest.raises(ConfigError, match="kv_heads"):
        ModelConfig(name="x", arch="llama", layers=2, hidden=64, ffn_hidden=128, heads=8, kv_heads=3, vocab=10, seq_len=8)
    with pytest.raises(ConfigError, match="--model"):
        load_model("no-such-model")


def test_qk_norm_is_a_llama_field_left_out_of_plans_without_it():
    """qk_norm (Qwen3's norm of each q and k head): 2 x head_dim weights a block, which every TP
    rank holds whole; true or false, llama blocks only (one line naming the field); absent from
    the dict of a model without it, so plans and their hashes read as before."""
    from planner.layers import layer_params_on_device
    tiny = ZOO["tiny"]
    qwen3 = dataclasses.replace(tiny, qk_norm=True)
    assert qwen3.block_params() - tiny.block_params() == 2 * tiny.dim_per_head
    assert layer_params_on_device(qwen3, 1, 4) - layer_params_on_device(tiny, 1, 4) == 2 * tiny.dim_per_head
    assert "qk_norm" not in tiny.to_dict() and qwen3.to_dict()["qk_norm"] is True
    assert ModelConfig.from_dict(qwen3.to_dict()) == qwen3
    with pytest.raises(ConfigError, match=r"^model.qk_norm: is 1; it must be true or false$"):
        dataclasses.replace(tiny, qk_norm=1)
    with pytest.raises(ConfigError, match=r"^model.qk_norm: per-head query and key norms are for llama"):
        dataclasses.replace(ZOO["tiny-gpt"], qk_norm=True)
    # exported (trident export) as Qwen3 or Qwen3-MoE: what neither computes is one line
    from planner.hf_config import to_hf_config
    from planner.moe import MoESpec
    assert to_hf_config(qwen3)["model_type"] == "qwen3"
    assert to_hf_config(dataclasses.replace(qwen3, moe=MoESpec(4, 2)))["architectures"] == ["Qwen3MoeForCausalLM"]
    with pytest.raises(ConfigError, match="q/k norms with q/k/v biases: no transformers model computes that"):
        to_hf_config(dataclasses.replace(qwen3, qkv_bias=True))
    with pytest.raises(ConfigError, match="q/k norms with a shared expert: no transformers MoE model"):
        to_hf_config(dataclasses.replace(qwen3, moe=MoESpec(4, 2, 64)))
