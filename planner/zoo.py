"""The zoo: models by name (`--model NAME`), each figure from its paper or released config.json."""
from __future__ import annotations

from planner import moe as moe_parts
from planner.model import ModelConfig


def _gpt(name, layers, hidden, heads, vocab=51200, seq_len=2048, ffn=None, tie=True):
    return ModelConfig(name=name, arch="gpt", layers=layers, hidden=hidden, ffn_hidden=ffn or 4 * hidden,
                       heads=heads, kv_heads=heads, vocab=vocab, seq_len=seq_len, tie_embeddings=tie)


def _llama(name, layers, hidden, ffn, heads, kv_heads, vocab, seq_len, theta=10000.0, eps=1e-5, **kw):
    return ModelConfig(name=name, arch="llama", layers=layers, hidden=hidden, ffn_hidden=ffn, heads=heads,
                       kv_heads=kv_heads, vocab=vocab, seq_len=seq_len, tie_embeddings=False,
                       norm_eps=eps, rope_theta=theta, **kw)


ZOO: dict[str, ModelConfig] = {m.name: m for m in [
    # CPU-sized models: a training step well under a second on one core; heads, kv_heads and
    # ffn_hidden divisible by 4 so that TP up to 4 runs.
    _llama("tiny", layers=4, hidden=128, ffn=384, heads=8, kv_heads=4, vocab=512, seq_len=64),
    _gpt("tiny-gpt", layers=4, hidden=128, heads=8, vocab=512, seq_len=64, tie=False),
    _llama("small", layers=8, hidden=512, ffn=1536, heads=8, kv_heads=4, vocab=4096, seq_len=256),
    # GPT rows of shared/reference/published_runs.csv (Megatron SC'21 Table 1, MT-NLG).
    _gpt("gpt-1.7b", 24, 2304, 24),
    _gpt("gpt-3.6b", 30, 3072, 32),
    _gpt("gpt-7.5b", 36, 4096, 32),
    _gpt("gpt-18.4b", 40, 6144, 48),
    _gpt("gpt-39.1b", 48, 8192, 64),
    _gpt("gpt-76.1b", 60, 10240, 80),
    _gpt("gpt-145.6b", 80, 12288, 96),
    _gpt("gpt-310.1b", 96, 16384, 128),
    _gpt("gpt-529.6b", 105, 20480, 128),
    _gpt("gpt-1008b", 128, 25600, 160),
    _gpt("mt-nlg-530b", 105, 20480, 128),
    # Brown et al. 2020 (GPT-3), Table 2.1; vocabulary of GPT-2's BPE.
    _gpt("gpt3-175b", 96, 12288, 96, vocab=50257),
    # Touvron et al. 2023 (Llama 2), and the released config.json files.
    _llama("llama2-7b", 32, 4096, 11008, 32, 32, 32000, 4096),
    _llama("llama2-13b", 40, 5120, 13824, 40, 40, 32000, 4096),
    _llama("llama2-70b", 80, 8192, 28672, 64, 8, 32000, 4096),
    # "The Llama 3 Herd of Models", 2024, Table 3, and the released config.json files.
    _llama("llama3-8b", 32, 4096, 14336, 32, 8, 128256, 8192, theta=500000.0),
    _llama("llama3-70b", 80, 8192, 28672, 64, 8, 128256, 8192, theta=500000.0),
    _llama("llama3-405b", 126, 16384, 53248, 128, 8, 128256, 8192, theta=500000.0),
    # Qwen3 (Yang et al. 2025, "Qwen3 Technical Report"), the released config.json files
    _llama("qwen3-8b", 36, 4096, 12288, 32, 8, 151936, 40960, theta=1e6, eps=1e-6, qk_norm=True),
    _llama("qwen3-32b", 64, 5120, 25600, 64, 8, 151936, 40960, theta=1e6, eps=1e-6, head_dim=128, qk_norm=True),
    # mixture of experts (planner.moe), the released config.json files: Jiang et al. 2024 (Mixtral),
    # Qwen3 (Qwen3-30B-A3B)
    _llama("mixtral-8x7b", 32, 4096, 14336, 32, 8, 32000, 32768, theta=1e6, moe=moe_parts.MoESpec(8, 2)),
    _llama("mixtral-8x22b", 56, 6144, 16384, 48, 8, 32768, 65536, theta=1e6, moe=moe_parts.MoESpec(8, 2)),
    _llama("qwen3-30b-a3b", 48, 2048, 768, 32, 4, 151936, 40960, theta=1e6, eps=1e-6, head_dim=128,
           qk_norm=True, moe=moe_parts.MoESpec(128, 8)),
    _llama("qwen3-235b-a22b", 94, 4096, 1536, 64, 4, 151936, 40960, theta=1e6, eps=1e-6, head_dim=128,
           qk_norm=True, moe=moe_parts.MoESpec(128, 8)),
]}
