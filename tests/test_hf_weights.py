"""Hugging Face weights (runtime.hf_weights, runtime.export): transformers computes what trident's
runtime computes from the same weights, both ways, through `trident export` and `--init-from`."""
from __future__ import annotations

import dataclasses
import json
import random
import shutil
import subprocess
import sys
import warnings

import pytest
import torch
import transformers
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from planner.hf_config import from_hf_config, to_hf_config
from planner.model import ConfigError, ModelConfig
from planner.moe import MoESpec
from planner.rope import RopeScaling
from planner.plan import Plan
from planner.zoo import ZOO
from runtime.data import make_source
from runtime.export import export
from runtime.hf_weights import ModelDir, from_hf, initial_weights, source, to_hf
from runtime.model import Transformer, init_weights
from torchrun_helpers import REPO, assert_ok, losses_of, train, write_plan

CONFIGS = {  # grouped-query llama; Qwen2's q/k/v biases, tied, another rope theta, linear rope scaling;
    # Llama 3.1's rope scaling; GPT-2 tied with its tanh GELU (gelu_new), and untied with exact GELU
    "llama-gqa": ModelConfig("t", "llama", 2, 64, 96, 8, 2, 128, 32),
    "qwen2-tied": ModelConfig("t", "llama", 2, 64, 96, 4, 4, 128, 32, tie_embeddings=True, qkv_bias=True,
                              norm_eps=1e-6, rope_theta=5e5, rope_scaling=RopeScaling("linear", 2.0)),
    # Llama 3.1's scaling: of head_dim 8's four wavelengths (6.3 to 6283 positions) the first
    # between original / high_freq_factor (4) and original / low_freq_factor (16), the rest above
    "llama3-rope": ModelConfig("t", "llama", 2, 64, 96, 8, 2, 128, 32,
                               rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 16)),
    "gpt-tied": ModelConfig("t", "gpt", 2, 64, 256, 4, 4, 128, 32, tie_embeddings=True, gelu_approximate="tanh"),
    "gpt": ModelConfig("t", "gpt", 2, 64, 200, 4, 4, 128, 32),
    # mixtures of experts (runtime.moe): Mixtral's (renormalized top k), Qwen2-MoE's (a gated shared
    # expert, q/k/v biases, the top k as they are)
    "mixtral": ModelConfig("t", "llama", 2, 64, 96, 8, 2, 128, 32, moe=MoESpec(4, 2)),
    "qwen2-moe": ModelConfig("t", "llama", 2, 64, 48, 4, 4, 128, 32, qkv_bias=True,
                             moe=MoESpec(4, 2, 64, normalize_top_k=False)),
    # Qwen3: each q and k head normalized (its weights reordered as the heads' rows), head_dim
    # apart from hidden / heads; Qwen3-MoE's experts, renormalized top k
    "qwen3": ModelConfig("t", "llama", 2, 64, 96, 4, 2, 128, 32, head_dim=32, qk_norm=True, norm_eps=1e-6, rope_theta=1e6),
    "qwen3-moe": ModelConfig("t", "llama", 2, 64, 32, 4, 2, 128, 32, qk_norm=True, moe=MoESpec(8, 2)),
}


MLP_INPUTS = (("w1.weight", "w3.weight"), ("c_fc.weight", "gate_proj.weight", "up_proj.weight"))


def _trident_model(cfg: ModelConfig, seed: int = 3) -> Transformer:
    """A trident model whose norms and biases are not their initial 1 and 0 (a mix-up would show)."""
    m = Transformer(cfg)
    init_weights(m, seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("bias") or "norm" in n:
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
            if n.endswith(MLP_INPUTS[0]):  # activations of order 1, where GELU's two forms differ by 1e-3
                p.mul_(10)
    return m.eval()


def _hf_model(cfg: ModelConfig):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = transformers.AutoConfig.for_model(**to_hf_config(cfg))
        if cfg.arch == "gpt":  # GPT2Config's token ids (50256) lie outside these vocabularies
            config.bos_token_id = config.eos_token_id = None
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(MLP_INPUTS[1]):  # as _trident_model
                p.mul_(10)
    return model


@pytest.mark.parametrize("name", CONFIGS)
def test_names_and_layouts_go_there_and_back(name):
    cfg = CONFIGS[name]
    m = _trident_model(cfg)
    state = {n: p.detach() for n, p in m.named_parameters(remove_duplicate=False)}
    hf = to_hf(cfg, state)
    assert all(torch.equal(from_hf(cfg, n, hf.__getitem__), t) for n, t in state.items())
    assert ("lm_head.weight" in hf) is not cfg.tie_embeddings
    back = from_hf_config(to_hf_config(cfg), name="t")
    assert back == cfg  # the config.json an export writes plans the same model


@pytest.mark.parametrize("name", CONFIGS)
def test_transformers_computes_the_same_logits_both_ways(name, tmp_path):
    """trident's weights in transformers' model give trident's logits (the rotary layout of q and k,
    GPT-2's fused Conv1D q/k/v, tied heads); transformers' own initialization saved with
    save_pretrained and read into trident's model (as --init-from does) gives transformers' logits."""
    cfg = CONFIGS[name]
    ids = torch.randint(0, cfg.vocab, (2, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    ours = _trident_model(cfg)
    if cfg.moe is None:
        hf = _hf_model(cfg)
        missing, unexpected = hf.load_state_dict(to_hf(cfg, dict(ours.named_parameters())), strict=False)
        assert not unexpected and set(missing) <= ({"lm_head.weight"} if cfg.tie_embeddings else set())
    else:  # transformers 5 fuses the experts' tensors as it loads a directory of them (as export writes it)
        from safetensors.torch import save_file
        (tmp_path / "ours").mkdir()
        save_file({k: v.contiguous() for k, v in to_hf(cfg, dict(ours.named_parameters())).items()},
                  tmp_path / "ours" / "model.safetensors", metadata={"format": "pt"})
        (tmp_path / "ours" / "config.json").write_text(json.dumps(to_hf_config(cfg)))
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids), rtol=1e-5, atol=1e-5)

    theirs = _hf_model(cfg)
    theirs.save_pretrained(tmp_path / "safetensors")  # transformers 5: an MoE's experts a tensor each again
    # transformers 4's sharded pytorch_model.bin (5 writes safetensors alone): two files and their index
    (tmp_path / "bin").mkdir()
    shutil.copy(tmp_path / "safetensors" / "config.json", tmp_path / "bin")
    state = {k: v.contiguous() for k, v in theirs.state_dict().items() if not (cfg.tie_embeddings and k == "lm_head.weight")}
    names = sorted(state)
    weight_map = {k: f"pytorch_model-0000{1 + (i % 2)}-of-00002.bin" for i, k in enumerate(names)}
    for f in set(weight_map.values()):
        torch.save({k: state[k] for k in names if weight_map[k] == f}, tmp_path / "bin" / f)
    (tmp_path / "bin" / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    plan = type("P", (), {"model": cfg, "training": type("T", (), {"seq_len": cfg.seq_len})})
    for saved in ("safetensors", "bin") if cfg.moe is None else ("safetensors",):  # state_dict: fused experts
        args = type("A", (), {"init_from": str(tmp_path / saved), "resume": False, "checkpoint_dir": None})
        loaded = Transformer(cfg)
        init_weights(loaded, 0, initial_weights(args, plan))
        with torch.no_grad():
            torch.testing.assert_close(loaded.eval()(ids), theirs(ids).logits, rtol=1e-5, atol=1e-5)


def _hf_loss(model, plan: Plan, step: int) -> float:
    t = plan.training
    batch = make_source("synthetic", t.seq_len, t.seed, plan.model.vocab).batch(step, t.global_batch)
    with torch.no_grad():
        logits = model(batch[:, :-1]).logits
    return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1).double(), batch[:, 1:].flatten()))


def test_an_exported_checkpoint_is_the_trained_model_and_starts_other_plans(tmp_path):
    """tp 2 with sequence parallelism trains 3 steps, a checkpoint after step 2; `trident export`
    of it loads in transformers, whose loss on step 3's batch is the run's step-3 loss; pp 2 (1F1B)
    and tp 2 started from the export with --init-from have that model's loss on their first batch. A tied GPT
    model initialized by transformers and saved with save_pretrained starts pp 2 (the head a copy of
    the embedding, runtime.tied) and dp 2 under ZeRO 3 at transformers' loss."""
    gpt = dataclasses.replace(ZOO["tiny-gpt"], name="tiny-gpt-tied", tie_embeddings=True)
    plans = {"tp2": write_plan(tmp_path, "tp2", world=2, tp=2, sequence_parallel=True),
             "pp2": write_plan(tmp_path, "pp2", world=2, pp=2, schedule="1f1b"),
             "gpt-pp2": write_plan(tmp_path, "gpt-pp2", model=gpt, world=2, pp=2, schedule="1f1b"),
             "gpt-zero3": write_plan(tmp_path, "gpt-zero3", model=gpt, world=2, zero=3)}
    assert_ok(train(2, "--plan", plans["tp2"], "--steps", 3, "--checkpoint-dir", tmp_path / "ck", "--checkpoint-every", 2,
                    "--out", tmp_path / "tp2-run.json"))
    out = tmp_path / "export"
    proc = subprocess.run([sys.executable, "-m", "planner.cli", "export", str(tmp_path / "ck"), "-o", str(out)],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert "exported step 2 of" in proc.stdout and json.loads((out / "config.json").read_text())["model_type"] == "llama"
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tp2 = Plan.read(plans["tp2"])
    proc = subprocess.run([sys.executable, "-m", "planner.cli", "export", str(tmp_path / "ck"), "-o",
                           str(tmp_path / "sharded"), "--max-shard-gb", "0.001"], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0 and "in 6 safetensors file(s)" in proc.stdout, proc.stdout + proc.stderr
    sharded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "sharded")  # through the index
    assert all(torch.equal(a, b) for a, b in zip(sharded.state_dict().values(), exported.state_dict().values()))
    export(tmp_path / "ck", tmp_path / "sharded", force=True)  # one file again: the 6 and their index go
    assert sorted(p.name for p in (tmp_path / "sharded").iterdir()) == ["config.json", "model.safetensors"]
    assert losses_of(tmp_path / "tp2-run.json")[2] == pytest.approx(_hf_loss(exported, tp2, 2), rel=1e-6)
    tok = tmp_path / "tokenizer"  # --tokenizer: the files and token ids of the model a run started from
    tok.mkdir()
    Tokenizer(WordLevel({"a": 0, "b": 1}, unk_token="a")).save(str(tok / "tokenizer.json"))
    (tok / "config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    assert export(tmp_path / "ck", tmp_path / "with-tokenizer", tokenizer=tok)["tokenizer_files"] == 1
    config = json.loads((tmp_path / "with-tokenizer" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (0, 1)
    assert (tmp_path / "with-tokenizer" / "tokenizer.json").read_bytes() == (tok / "tokenizer.json").read_bytes()
    shutil.copytree(tmp_path / "ck" / "step-2", tmp_path / "wider" / "step-2")  # trident.json of another model
    meta = json.loads((tmp_path / "wider" / "step-2" / "trident.json").read_text())
    meta["run"]["model"]["ffn_hidden"] *= 2
    (tmp_path / "wider" / "step-2" / "trident.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match=r"the checkpoint's model\..*w1\.weight is \[\d+, \d+\], where the model "):
        export(tmp_path / "wider", tmp_path / "wider-export")
    runs = tmp_path / "from-export"  # pp 2, and tp 2 with SP again, each from the export
    assert_ok(train(2, "--plan", plans["pp2"], plans["tp2"], "--steps", 1, "--init-from", out, "--out", runs))
    for name in ("pp2", "tp2"):
        assert losses_of(runs / f"{name}.json")[0] == pytest.approx(_hf_loss(exported, tp2, 0), rel=1e-6), name
    first = Plan.read(plans["pp2"]).pipeline.stages[0]  # rank 0's: plain tensors, read whole
    held = len(list(Transformer(tp2.model, first.start, first.end).parameters()))
    assert json.loads((runs / "pp2.json").read_text())["init_from"] == {"path": str(out), "whole": held, "sliced": 0}
    # tp 2's rank reads its block of every tensor alone: whole heads of q and k (reordered), its
    # rows or columns of the others, the replicated norms whole
    read = json.loads((runs / "tp2.json").read_text())["init_from"]
    assert (read["whole"], read["sliced"]) == (0, len(list(Transformer(tp2.model).parameters())))

    hf_gpt = _hf_model(gpt)
    hf_gpt.save_pretrained(tmp_path / "gpt")
    assert_ok(train(2, "--plan", plans["gpt-pp2"], plans["gpt-zero3"], "--steps", 1, "--init-from", tmp_path / "gpt",
                    "--out", tmp_path / "runs"))
    want = _hf_loss(hf_gpt, Plan.read(plans["gpt-pp2"]), 0)
    for name in ("gpt-pp2", "gpt-zero3"):
        assert losses_of(tmp_path / "runs" / f"{name}.json")[0] == pytest.approx(want, rel=1e-6), name
    # ZeRO 3's rank reads its half of each tensor alone (FSDP2's row shards; q, k and v of GPT-2's
    # fused projection its columns)
    read = json.loads((tmp_path / "runs" / "gpt-zero3.json").read_text())["init_from"]
    assert (read["whole"], read["sliced"]) == (0, len(list(Transformer(gpt).parameters())))


def _saved(cfg: ModelConfig, path, **config_edits):
    """transformers' model of `cfg` saved to `path`, its config.json then edited."""
    _hf_model(cfg).save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    config.update(config_edits)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("name, edits, plan_edits, message", [
    ("llama-gqa", {"hidden_size": 128, "head_dim": 16}, {}, r"has model.hidden = 128, the plan 64; plan with --model "),
    ("llama-gqa", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 8.0}}, {},
     r"rope type 'yarn' .*scale as linear or llama3 only"),
    ("llama-gqa", {"model_type": "gemma"}, {}, r"cannot load gemma weights"),
    ("llama-gqa", {"model_type": "mistral", "sliding_window": 16}, {},
     r"sliding_window: 16 is below the plan's seq_len 32"),
    ("gpt", {"activation_function": "gelu_new"}, {}, r"has model.gelu_approximate = 'tanh', the plan 'none'"),
    ("gpt", {"activation_function": "relu"}, {}, r"activation_function: 'relu' is not a GELU, which trident's GPT"),
    ("llama-gqa", {"attention_bias": True}, {"qkv_bias": True}, r"no place for: model.layers.0.self_attn.o_proj.bias"),
])
def test_weights_trident_would_compute_otherwise_are_refused_by_name(tmp_path, name, edits, plan_edits, message):
    cfg = CONFIGS[name]
    if "attention_bias" in edits:  # a Llama config's attention_bias: q, k, v and o biases
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hf = transformers.AutoModelForCausalLM.from_config(
                transformers.AutoConfig.for_model(**{**to_hf_config(cfg), **edits}))
        hf.save_pretrained(tmp_path)
    else:
        _saved(cfg, tmp_path, **edits)
    with pytest.raises(ConfigError, match=message):
        ModelDir(tmp_path).check(dataclasses.replace(cfg, **plan_edits), 32)


def test_gpt2_hub_names_and_missing_directories(tmp_path):
    """GPT-2's files on the Hub name tensors without `transformer.` (and keep the causal-mask
    buffers): they load. A directory without config.json or weights is one line."""
    cfg = CONFIGS["gpt-tied"]
    hf = _hf_model(cfg)
    hf.save_pretrained(tmp_path / "hub")
    from safetensors.torch import load_file, save_file
    state = {k.removeprefix("transformer."): v for k, v in load_file(tmp_path / "hub" / "model.safetensors").items()}
    state["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, cfg.seq_len, cfg.seq_len))
    save_file(state, tmp_path / "hub" / "model.safetensors")
    d = ModelDir(tmp_path / "hub")
    d.check(cfg, 32)
    loaded = Transformer(cfg)
    init_weights(loaded, 0, lambda n, shape: from_hf(cfg, n, d.read))
    ids = torch.randint(0, cfg.vocab, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(ids), hf(ids).logits, rtol=1e-5, atol=1e-5)
    with pytest.raises(ConfigError, match=r"--init-from: .*nowhere/config.json is missing or not JSON"):
        ModelDir(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(json.dumps(to_hf_config(cfg)))
    with pytest.raises(ConfigError, match=r"has no model.safetensors, .* save the model with save_pretrained"):
        ModelDir(tmp_path / "empty")
    # weights holding a NaN: named when read, not left to the first step's loss (read as divergence)
    state["wte.weight"][3, 5] = float("nan")
    save_file(state, tmp_path / "hub" / "model.safetensors")
    plan = type("P", (), {"model": cfg, "training": type("T", (), {"seq_len": 32})})
    args = type("A", (), {"init_from": str(tmp_path / "hub"), "resume": False, "checkpoint_dir": None})
    with pytest.raises(ConfigError, match=r"--init-from: .*hub: .*wte.weight holds NaN or infinite values"):
        init_weights(Transformer(cfg), 0, initial_weights(args, plan))


def test_the_commands_refuse_bad_input_in_one_line(tmp_path, capsys):
    """As processes (`trident run`, `trident export`), then the other cases in this one (the same
    main, without a Python start-up each)."""
    from planner.cli import main
    from test_bad_input import one_line_error
    plan = write_plan(tmp_path, "one")

    def cli(*args):
        proc = subprocess.run([sys.executable, "-m", "planner.cli", *map(str, args)], capture_output=True,
                              text=True, cwd=REPO)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        return proc.stderr

    def here(*args):
        code, line = one_line_error(capsys, main, list(map(str, args)))
        assert code == 2, line
        return line
    assert "--init-from: " in cli("run", plan, "--init-from", tmp_path / "nowhere")
    assert "no checkpoint there" in cli("export", tmp_path, "-o", tmp_path / "out")
    (tmp_path / "ck" / "step-1").mkdir(parents=True)
    (tmp_path / "ck" / "step-1" / "trident.json").write_text("{}")
    assert "unreadable or corrupt" in here("export", tmp_path / "ck", "-o", tmp_path / "out")
    assert "-o: " in here("export", tmp_path / "ck", "-o", tmp_path)
    assert "holds no tokenizer files" in here("export", tmp_path / "ck", "-o", tmp_path / "o", "--tokenizer", tmp_path)
    assert "--max-shard-gb: 0.0 must be positive" in here("export", tmp_path / "ck", "-o", tmp_path / "o",
                                                          "--max-shard-gb", 0)
    # a whole trident.json beside a torn .metadata: one line, and no empty -o directory left
    from planner.plan import Plan
    from runtime import checkpoint
    p = Plan.read(plan)
    (tmp_path / "ck" / "step-1" / "trident.json").write_text(json.dumps(
        {"plan_hash": p.content_hash(), "layout": checkpoint.BY_NAME, "run": checkpoint.run_of(p), "step": 1,
         "data": {"next_step": 1}}))
    (tmp_path / "ck" / "step-1" / ".metadata").write_bytes(b"\x80not a pickle")
    assert ".metadata cannot be read" in here("export", tmp_path / "ck", "-o", tmp_path / "o2")
    assert not (tmp_path / "o2").exists()


@pytest.mark.parametrize("name", CONFIGS)
def test_a_block_read_alone_is_that_block_of_the_whole_tensor(name):
    """What --init-from reads for a sharded parameter (HFInit.local): any block of any parameter,
    read from transformers' tensor alone, is that block of the whole; a q or k block whose rows cut
    a head (reordered as a whole) is not read alone (None: the rank reads the whole tensor)."""
    cfg = CONFIGS[name]
    state = {n: p.detach() for n, p in _trident_model(cfg).named_parameters(remove_duplicate=False)}
    hf = to_hf(cfg, state)
    gen = random.Random(0)
    for n, t in state.items():
        hf_name, layout = source(cfg, n)
        assert layout.shape(hf[hf_name].shape) == tuple(t.shape), n
        blocks = [([0] * t.dim(), list(t.shape))]  # the whole, and halves of the rows (a TP or FSDP shard)
        blocks += [([h] + [0] * (t.dim() - 1), [r] + list(t.shape[1:]))
                   for h, r in ((0, t.shape[0] // 2), (t.shape[0] // 2, t.shape[0] - t.shape[0] // 2))]
        for _ in range(6):
            offset = [gen.randrange(d) for d in t.shape]
            blocks.append((offset, [gen.randint(1, d - o) for d, o in zip(t.shape, offset)]))
        for offset, size in blocks:
            block = layout.block(hf[hf_name], offset, size)
            if block is None:
                assert layout.head and (offset[0] % layout.head or size[0] % layout.head), (n, offset, size)
                continue
            torch.testing.assert_close(block, t[tuple(slice(o, o + s) for o, s in zip(offset, size))], rtol=0, atol=0)
