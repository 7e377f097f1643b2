"""Hugging Face config.json files as trident models (planner.model.ModelConfig)."""
from __future__ import annotations

import dataclasses

from planner.model import ConfigError, ModelConfig, is_int, is_real
from planner.rope import ROPE_SCALINGS, RopeScaling


# max_position_embeddings where a config leaves it out: the defaults of transformers'
# configuration_<model_type>.py (Mistral's 4096 * 32); GPT-2's n_positions defaults to 1024
MAX_POSITIONS = {"llama": 2048, "mistral": 131072, "qwen2": 32768, "qwen3": 32768, "phi3": 4096, "gemma": 8192,
                 "gemma2": 8192, "mixtral": 131072, "qwen2_moe": 32768, "qwen3_moe": 32768}
EXACT_GELUS = ("gelu", "gelu_python")  # transformers' activation_function names of exact GELU
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_python_tanh", "gelu_fast")  # its tanh approximation's
LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "mixtral", "qwen2_moe", "qwen3_moe")
# mixture-of-experts configs (planner.moe): (experts, experts_per_token, expert width, shared expert
# width) keys with the defaults of transformers' configuration_<model_type>.py
MOE_KEYS = {"mixtral": (("num_local_experts", 8), ("num_experts_per_tok", 2), ("intermediate_size", 14336), None),
            "qwen2_moe": (("num_experts", 60), ("num_experts_per_tok", 4), ("moe_intermediate_size", 1408),
                          ("shared_expert_intermediate_size", 5632)),
            "qwen3_moe": (("num_experts", 128), ("num_experts_per_tok", 8), ("moe_intermediate_size", 768), None)}


def from_hf_config(cfg: dict, name: str = "hf-model", where: str = "config.json") -> ModelConfig:
    """Map a Hugging Face config.json (model_type llama, mistral, qwen2, qwen3, phi3, gemma, gemma2,
    the mixtures of experts mixtral, qwen2_moe and qwen3_moe (planner.moe; ffn_hidden is an expert's
    width), or gpt2) to a ModelConfig. A key given as null counts as absent (Hugging Face's own convention), except for
    required keys. Qwen3 and Phi-3 are Llama blocks (RMSNorm, SwiGLU, RoPE, grouped-query
    attention) with what their configs say: Qwen3's head_dim (128 where hidden / heads may be 64)
    and no QKV bias, Phi-3's fused QKV and gate/up projections (the same parameters and FLOPs as
    separate ones). Qwen3's RMSNorm of each query and key head is the model's qk_norm. Gemma and Gemma 2 are Llama blocks too, their embedding
    and head tied by default (transformers' configuration_gemma*.py), their head_dim (256) apart
    from hidden / heads; their gated GELU MLP has SwiGLU's parameters and FLOPs and is priced and
    trained as SwiGLU. Gemma 2's two extra norms a block (2 x hidden weights, under 0.01%) are left
    out, and its sliding-window layers (every other one) are priced as full attention: exact up to
    its sliding_window (4096 tokens), an over-prediction of their attention beyond."""
    if not isinstance(cfg, dict):
        raise ConfigError(f"{where}: expected a JSON object")
    mt = cfg.get("model_type")

    def get(key, check, what, default=...):
        v = cfg.get(key)
        if v is None:
            if default is not ...:
                return default
            if key in cfg:
                raise ConfigError(f"{where}: {key}: is null; it must be {what}")
            raise ConfigError(f"{where}: missing {key!r}, which a {mt} config must have")
        if not check(v):
            raise ConfigError(f"{where}: {key}: is {v!r}; it must be {what}")
        return v

    def pos_int(key, default=...):
        return get(key, lambda v: is_int(v) and v > 0, "a positive integer", default)

    def eps(key):
        # absent: the default of transformers' configuration_<model_type>.py (Phi-3's and GPT-2's 1e-5)
        default = 1e-5 if mt in ("phi3", "gpt2") else 1e-6
        return float(get(key, lambda v: is_real(v) and 0 < v < 1, "a number between 0 and 1 (exclusive)", default))

    def flag(key, default):
        return get(key, lambda v: isinstance(v, bool), "true or false", default)

    if mt in LLAMA_LIKE:
        heads, hidden = pos_int("num_attention_heads"), pos_int("hidden_size")
        head_dim = pos_int("head_dim", None)
        kw = dict(arch="llama", layers=pos_int("num_hidden_layers"), hidden=hidden,
                  heads=heads, kv_heads=pos_int("num_key_value_heads", heads),
                  vocab=pos_int("vocab_size"), seq_len=pos_int("max_position_embeddings", MAX_POSITIONS[mt]),
                  tie_embeddings=flag("tie_word_embeddings", mt in ("gemma", "gemma2")),
                  qkv_bias=flag("attention_bias", False) or mt in ("qwen2", "qwen2_moe"),  # Qwen2 always has them
                  qk_norm=mt in ("qwen3", "qwen3_moe"),
                  head_dim=head_dim if head_dim != hidden // heads else None, norm_eps=eps("rms_norm_eps"),
                  rope_theta=rope_theta(cfg, where), rope_scaling=rope_scaling(cfg, where))
        kw.update(moe_fields(cfg, mt, where, pos_int) if mt in MOE_KEYS
                  else {"ffn_hidden": pos_int("intermediate_size")})
    elif mt == "gpt2":
        h, heads = pos_int("n_embd"), pos_int("n_head")
        kw = dict(arch="gpt", layers=pos_int("n_layer"), hidden=h, ffn_hidden=pos_int("n_inner", 4 * h),
                  heads=heads, kv_heads=heads, vocab=pos_int("vocab_size"), seq_len=pos_int("n_positions", 1024),
                  tie_embeddings=flag("tie_word_embeddings", True), norm_eps=eps("layer_norm_epsilon"),
                  # absent: GPT2Config's default, gelu_new (tanh)
                  gelu_approximate=gelu_kind(cfg.get("activation_function", "gelu_new"), where))
    else:
        raise ConfigError(f"{where}: model_type {mt!r} is not supported; use {', '.join(LLAMA_LIKE)} or gpt2")
    return ModelConfig(name=name, **kw)


def gelu_kind(act, where: str) -> str:
    """gelu_approximate of a GPT-2 config's activation_function: trident's GPT blocks run GELU."""
    if act in EXACT_GELUS or act in TANH_GELUS:
        return "none" if act in EXACT_GELUS else "tanh"
    raise ConfigError(f"{where}: activation_function: {act!r} is not a GELU, which trident's GPT blocks run; use one "
                      f"of {', '.join(EXACT_GELUS + TANH_GELUS)}")


def moe_fields(cfg: dict, mt: str, where: str, pos_int) -> dict:
    """ffn_hidden and moe of a mixture-of-experts config, whose blocks must all be MoE blocks (Qwen's
    decoder_sparse_step 1 and no mlp_only_layers: the configs released so)."""
    experts, k, width, shared = MOE_KEYS[mt]
    if cfg.get("decoder_sparse_step", 1) != 1 or cfg.get("mlp_only_layers"):
        raise ConfigError(f"{where}: decoder_sparse_step / mlp_only_layers: dense blocks between the MoE blocks are "
                          "not modeled; trident prices a model whose blocks are all MoE blocks")
    norm = cfg.get("norm_topk_prob", False)  # Qwen's configs; Mixtral's routing always renormalizes
    if not isinstance(norm, bool):
        raise ConfigError(f"{where}: norm_topk_prob: is {norm!r}; it must be true or false")
    if cfg.get(experts[0]) is None and cfg.get("num_local_experts") is not None:
        experts = ("num_local_experts", None)  # transformers 5 saves Qwen3-MoE's num_experts by this name
    moe = {"experts": pos_int(*experts), "experts_per_token": pos_int(*k),
           "shared_ffn_hidden": pos_int(*shared) if shared else 0, "normalize_top_k": mt == "mixtral" or norm}
    return {"ffn_hidden": pos_int(*width), "moe": moe}


def rope_parameters(cfg: dict) -> dict:
    """The rotary settings of a config: transformers 5's `rope_parameters` object (rope_theta,
    rope_type), or the top-level rope_theta and rope_scaling of the configs before it."""
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict):
        return rp
    scaling = cfg.get("rope_scaling")
    return {**(scaling if isinstance(scaling, dict) else {}), "rope_theta": cfg.get("rope_theta")}


def rope_theta(cfg: dict, where: str) -> float:
    v = rope_parameters(cfg).get("rope_theta")
    if v is None:
        return 10000.0  # transformers' default
    if not (is_real(v) and v > 0):
        raise ConfigError(f"{where}: rope_theta: is {v!r}; it must be a positive number")
    return float(v)


def rope_scaling(cfg: dict, where: str) -> RopeScaling | None:
    """A config's rope scaling where the runtime computes it (linear, llama3); None for none and
    for other kinds (dynamic NTK, YaRN, LongRoPE: priced alike, their weights refused by
    runtime.hf_weights)."""
    for key in ("rope_scaling", "rope_parameters"):
        if not isinstance(cfg.get(key), (dict, type(None))):
            raise ConfigError(f"{where}: {key}: {cfg[key]!r} must be an object (or null: none)")
    rp = rope_parameters(cfg)
    kind = rp.get("rope_type") or rp.get("type")
    if not isinstance(kind, (str, type(None))):
        raise ConfigError(f"{where}: rope_scaling.rope_type: {kind!r} must be a name such as linear or llama3")
    if kind not in ROPE_SCALINGS:
        return None
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    fields = {k: rp[k] for k in (keys if kind == "llama3" else keys[:1]) if rp.get(k) is not None}
    return RopeScaling.from_dict({"type": kind, **fields}, where=f"{where}: rope_scaling")


HF_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def to_hf_config(cfg: ModelConfig, dtype: str = "fp32", dropout: float = 0.0, attention_dropout: float = 0.0) -> dict:
    """The config.json of a transformers model computing what trident's runtime computes for
    `cfg` (`trident export`): gpt as GPT2LMHeadModel (gelu, or gelu_new: tanh), llama as LlamaForCausalLM,
    Qwen2ForCausalLM where the q, k, v projections have biases (a Llama config's
    attention_bias adds one to the output projection too, which trident's blocks lack), or
    Qwen3ForCausalLM where each q and k head is normalized; an MoE model as moe_type says. The
    dropouts are the run's, for training on in transformers."""
    common = {"vocab_size": cfg.vocab, "tie_word_embeddings": cfg.tie_embeddings, "torch_dtype": HF_DTYPES[dtype]}
    if cfg.arch == "gpt":
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": cfg.layers, "n_embd": cfg.hidden,
                "n_inner": cfg.ffn_hidden, "n_head": cfg.heads, "n_positions": cfg.seq_len,
                "layer_norm_epsilon": cfg.norm_eps, "resid_pdrop": dropout,
                "activation_function": "gelu_new" if cfg.gelu_approximate == "tanh" else "gelu",
                "embd_pdrop": dropout, "attn_pdrop": attention_dropout, **common}
    mt = moe_type(cfg) if cfg.moe is not None else dense_type(cfg)
    arch = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}[mt]
    out = {"architectures": [arch], "model_type": mt,
           "num_hidden_layers": cfg.layers, "hidden_size": cfg.hidden, "intermediate_size": cfg.ffn_hidden,
           "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.dim_per_head,
           "max_position_embeddings": cfg.seq_len, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
           "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},  # transformers 5's spelling
           "hidden_act": "silu", "attention_dropout": attention_dropout, **common}
    if cfg.rope_scaling is not None:  # both spellings: transformers 4's rope_scaling, 5's rope_parameters
        scaling = {k: v for k, v in dataclasses.asdict(cfg.rope_scaling).items() if k != "type"}
        if cfg.rope_scaling.type == "linear":
            scaling = {"factor": cfg.rope_scaling.factor}
        out["rope_scaling"] = {"rope_type": cfg.rope_scaling.type, **scaling}
        out["rope_parameters"].update(out["rope_scaling"])
    if mt in ("llama", "qwen3", "qwen3_moe"):
        out.update(attention_bias=False, mlp_bias=False)
    elif mt != "mixtral":
        out.update(use_sliding_window=False)
    if cfg.moe is not None:  # planner.moe; the router's auxiliary loss off there (trident's is the run's)
        m = cfg.moe
        out.update(num_experts_per_tok=m.experts_per_token, output_router_logits=False)
        if mt == "mixtral":
            out.update(num_local_experts=m.experts, sliding_window=None, router_jitter_noise=0.0)
        else:
            out.update(num_experts=m.experts, moe_intermediate_size=cfg.ffn_hidden, norm_topk_prob=m.normalize_top_k,
                       decoder_sparse_step=1, mlp_only_layers=[])
            if mt == "qwen2_moe":
                out.update(shared_expert_intermediate_size=m.shared_ffn_hidden)
    return out


def dense_type(cfg: ModelConfig) -> str:
    """The transformers model type of a dense llama-family model: Qwen3 (each q and k head normalized,
    no biases), Qwen2 (q/k/v biases) or Llama. ConfigError for both."""
    if cfg.qk_norm and cfg.qkv_bias:
        raise ConfigError(f"{cfg.name}: q/k norms with q/k/v biases: no transformers model computes that "
                          "(Qwen3 has the norms, Qwen2 the biases)")
    return "qwen3" if cfg.qk_norm else "qwen2" if cfg.qkv_bias else "llama"


def moe_type(cfg: ModelConfig) -> str:
    """The transformers model type of an MoE model (runtime.hf_weights names its tensors so): Qwen3-MoE
    (q/k norms; neither a shared expert nor biases), Qwen2-MoE (a shared expert with its gate, q/k/v
    biases, the top k renormalized or not), or Mixtral (neither, always renormalized). ConfigError
    for a model none computes."""
    m = cfg.moe
    if cfg.qk_norm:
        if m.shared_ffn_hidden or cfg.qkv_bias:
            raise ConfigError(f"{cfg.name}: q/k norms with {'a shared expert' if m.shared_ffn_hidden else 'q/k/v biases'}: "
                              "no transformers MoE model computes that (Qwen3-MoE has neither)")
        return "qwen3_moe"
    if m.shared_ffn_hidden or cfg.qkv_bias:
        if not (m.shared_ffn_hidden and cfg.qkv_bias):
            has, lacks = ("a shared expert", "q/k/v biases")[::1 if m.shared_ffn_hidden else -1]
            raise ConfigError(f"{cfg.name}: {has} without {lacks}: no transformers MoE model computes that "
                              "(Qwen2-MoE has both, Mixtral neither)")
        return "qwen2_moe"
    if not m.normalize_top_k:
        raise ConfigError(f"{cfg.name}: moe.normalize_top_k false without a shared expert: no transformers MoE "
                          "model computes that (Mixtral renormalizes)")
    return "mixtral"


# the dropout probabilities Hugging Face configs train with: hidden states (GPT-2's resid_pdrop and
# embd_pdrop, others' hidden_dropout) and attention probabilities (attn_pdrop, attention_dropout)
HIDDEN_DROPOUT_KEYS = ("resid_pdrop", "embd_pdrop", "hidden_dropout", "hidden_dropout_prob")
ATTENTION_DROPOUT_KEYS = ("attn_pdrop", "attention_dropout", "attention_probs_dropout_prob")


def config_dropouts(cfg: dict) -> tuple[float, float]:
    """(hidden, attention) dropout a Hugging Face config sets (the largest of its keys; 0 where none)."""
    def largest(keys):
        return max([float(cfg[k]) for k in keys if is_real(cfg.get(k))] or [0.0])
    return largest(HIDDEN_DROPOUT_KEYS), largest(ATTENTION_DROPOUT_KEYS)

