"""Hugging Face weights: trident's parameters by the names transformers gives them.

`trident export` writes a checkpoint's model as a transformers model directory (config.json and
safetensors files); `trident run --init-from DIR` starts a run from such a directory's weights
(fine-tuning a published model, or going on from an export under any plan).

Name and layout differences (transformers' modeling_llama.py, modeling_qwen2.py, modeling_gpt2.py):
- llama family: the blocks are 0-based (trident's layer i is model.layers.{i-1}); rotary
  embeddings rotate the halves of a head (x[j], x[j + d/2]) where trident rotates adjacent pairs
  (x[2j], x[2j+1]) (Meta's original layout), so the rows of each head's q and k projections
  (weights and biases) and Qwen3's q and k norm weights (one head's) are reordered on the way:
  the same attention scores, the same model;
- gpt2: Conv1D layers keep weights as [in, out] (trident's nn.Linear: [out, in]) and q, k, v are
  one projection (c_attn, q then k then v);
- a tied head has no tensor of its own there (lm_head is the embedding).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from planner.hf_config import EXACT_GELUS, TANH_GELUS, from_hf_config, moe_type, rope_parameters
from planner.model import ConfigError, ModelConfig
from planner.rope import ROPE_SCALINGS
from runtime.tied import head_weight

# whose blocks trident's runtime computes exactly (mixtral, qwen2_moe and qwen3_moe: runtime.moe)
WEIGHT_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gpt2", "mixtral", "qwen2_moe", "qwen3_moe")
# GPT-2's activation_function values the runtime computes (transformers' activations.py: gelu and
# gelu_python exact, the others the tanh approximation written in several ways): planner.hf_config
GELUS = EXACT_GELUS + TANH_GELUS
# tensors of a model directory that are not weights (gpt2's causal-mask buffers in older files)
_NOT_WEIGHTS = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")


def to_halves(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a q or k projection from trident's rotary layout (adjacent pairs) to transformers'
    (halves of each head)."""
    d = w.shape[0] // heads
    return w.reshape(heads, d // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def to_pairs(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of to_halves."""
    d = w.shape[0] // heads
    return w.reshape(heads, 2, d // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


_LLAMA_BLOCK = {  # trident's name in a block -> transformers', model.layers.{j}.<this>
    "attention_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight", "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.weight": "self_attn.k_proj.weight", "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.weight": "self_attn.v_proj.weight", "attention.wv.bias": "self_attn.v_proj.bias",
    "attention.wo.weight": "self_attn.o_proj.weight", "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight", "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight", "attention.k_norm.weight": "self_attn.k_norm.weight",
}
_GPT_BLOCK = {  # trident's name -> (transformers' transformer.h.{j}.<this>, transposed)
    "attention_norm.weight": ("ln_1.weight", False), "attention_norm.bias": ("ln_1.bias", False),
    "ffn_norm.weight": ("ln_2.weight", False), "ffn_norm.bias": ("ln_2.bias", False),
    "attention.wo.weight": ("attn.c_proj.weight", True), "attention.wo.bias": ("attn.c_proj.bias", False),
    "feed_forward.w1.weight": ("mlp.c_fc.weight", True), "feed_forward.w1.bias": ("mlp.c_fc.bias", False),
    "feed_forward.w2.weight": ("mlp.c_proj.weight", True), "feed_forward.w2.bias": ("mlp.c_proj.bias", False),
}
_GPT_QKV = ("attention.wq.", "attention.wk.", "attention.wv.")
# an MoE block's feed-forward (runtime.moe): trident's name after "feed_forward." -> transformers'
# (its files' layout, one tensor an expert, which transformers 5 fuses when it loads them) in a
# Mixtral block and in a Qwen2-MoE or Qwen3-MoE one
_QWEN_EXPERTS = {"router": "gate", "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_MOE = {"mixtral": ("block_sparse_moe.", {"router": "gate", "w1": "w1", "w3": "w3", "w2": "w2"}),
        "qwen2_moe": ("mlp.", {**_QWEN_EXPERTS, "shared": "shared_expert", "shared_gate": "shared_expert_gate"}),
        "qwen3_moe": ("mlp.", _QWEN_EXPERTS)}


def _moe_name(cfg: ModelConfig, rest: str) -> str:
    """transformers' name of an MoE block's feed-forward tensor `rest` (feed_forward.experts.3.w1.weight)."""
    prefix, names = _MOE[moe_type(cfg)]
    parts = rest.split(".")[1:]  # without "feed_forward"
    return prefix + ".".join(names.get(p, p) for p in parts)


def _outer_names(cfg: ModelConfig) -> dict[str, str]:
    """Embedding, final norm and head: trident's name -> transformers'."""
    last = cfg.num_layers_total - 1
    if cfg.arch == "gpt":
        names = {"layers.0.tok_embeddings.weight": "transformer.wte.weight",
                 "layers.0.pos_embeddings.weight": "transformer.wpe.weight",
                 f"layers.{last}.norm.weight": "transformer.ln_f.weight",
                 f"layers.{last}.norm.bias": "transformer.ln_f.bias"}
    else:
        names = {"layers.0.tok_embeddings.weight": "model.embed_tokens.weight",
                 f"layers.{last}.norm.weight": "model.norm.weight"}
    # a tied head reads the embedding (a pipeline's head keeps a copy of it: runtime.tied)
    names[f"layers.{last}.output.weight"] = names["layers.0.tok_embeddings.weight"] if cfg.tie_embeddings \
        else "lm_head.weight"
    return names


def _split(name: str) -> tuple[int, str]:
    _, index, rest = name.split(".", 2)
    return int(index), rest


@dataclass(frozen=True)
class Layout:
    """How one of trident's tensors is laid out in transformers' tensor: transposed (GPT-2's
    Conv1D), `rows` of it from row `row0` on (after transposing: GPT-2's fused q, k, v), each head
    of `head` rows reordered from halves to pairs (q and k of a llama block)."""

    transposed: bool = False
    row0: int = 0
    rows: int | None = None
    head: int = 0

    def full(self, t: torch.Tensor) -> torch.Tensor:
        return self.block(t, [0] * t.dim(), self.shape(t.shape))

    def shape(self, hf_shape) -> tuple:
        """trident's shape of a transformers tensor of `hf_shape`."""
        shape = list(hf_shape)[::-1] if self.transposed else list(hf_shape)
        if self.rows is not None:
            shape[0] = self.rows if self.row0 + self.rows <= shape[0] else -1
        return tuple(shape)

    def block(self, hf, offset, size) -> torch.Tensor | None:
        """trident's block [offset, offset + size) read from `hf` (a tensor or a safetensors slice),
        or None where its rows cut a head that is reordered (the reorder needs the whole head)."""
        if self.head and (offset[0] % self.head or size[0] % self.head):
            return None
        index = [slice(o, o + n) for o, n in zip(offset, size)]
        index[0] = slice(self.row0 + offset[0], self.row0 + offset[0] + size[0])
        t = hf[tuple(index[::-1] if self.transposed else index)]
        t = t.t() if self.transposed else t
        return to_pairs(t, size[0] // self.head) if self.head else t


def source(cfg: ModelConfig, name: str) -> tuple[str, Layout]:
    """The transformers tensor trident's parameter `name` comes from, and its layout there."""
    outer = _outer_names(cfg)
    if name in outer:
        return outer[name], Layout()
    i, rest = _split(name)
    if cfg.arch == "gpt":
        if rest.startswith(_GPT_QKV):
            kind, part = rest.rsplit(".", 1)[1], _GPT_QKV.index(rest[:len("attention.wq.")])
            return (f"transformer.h.{i - 1}.attn.c_attn.{kind}",
                    Layout(transposed=kind == "weight", row0=part * cfg.hidden, rows=cfg.hidden))
        hf, transposed = _GPT_BLOCK[rest]
        return f"transformer.h.{i - 1}.{hf}", Layout(transposed=transposed)
    moe = cfg.moe is not None and rest.startswith("feed_forward.")
    hf = f"model.layers.{i - 1}.{_moe_name(cfg, rest) if moe else _LLAMA_BLOCK[rest]}"
    if rest.startswith(("attention.wq.", "attention.wk.", "attention.q_norm.", "attention.k_norm.")):
        return hf, Layout(head=cfg.dim_per_head)
    return hf, Layout()


def from_hf(cfg: ModelConfig, name: str, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """The full tensor of trident's parameter `name`, from transformers' tensors (`read`)."""
    hf, layout = source(cfg, name)
    return layout.full(read(hf))


def to_hf(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full (unsharded) tensors by trident's names -> by transformers' (a tied head left out): each
    laid out as `source` says, GPT-2's q, k and v joined into one tensor by their rows."""
    parts: dict[str, list] = {}
    for name, t in state.items():
        if cfg.tie_embeddings and name == head_weight(cfg):  # the embedding's tensor there
            continue
        hf, layout = source(cfg, name)
        parts.setdefault(hf, []).append((layout, to_halves(t, t.shape[0] // layout.head) if layout.head else t))
    out = {}
    for hf, ps in parts.items():
        ps.sort(key=lambda p: p[0].row0)
        t = torch.cat([t for _, t in ps]) if len(ps) > 1 else ps[0][1]
        out[hf] = (t.t() if ps[0][0].transposed else t).contiguous()
    return out


class ModelDir:
    """A transformers model directory (config.json; model.safetensors or pytorch_model.bin, or
    either's shards with their index), read a tensor at a time."""

    def __init__(self, path: str | Path, flag: str = "--init-from"):
        self.path, self.flag = Path(path), flag
        cfg_path = self.path / "config.json"
        try:
            self.hf = json.loads(cfg_path.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{flag}: {cfg_path} is missing or not JSON ({type(exc).__name__}); give a "
                              "transformers model directory (config.json and model.safetensors)") from None
        self.config = from_hf_config(self.hf, name=self.path.name or "hf-model", where=str(cfg_path))
        self._open = {}
        self._files = self._weight_files()

    def _weight_files(self) -> dict[str, Path]:
        """transformers' tensor name -> the file holding it."""
        for fname in ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin.index.json",
                      "pytorch_model.bin"):  # safetensors first, as transformers' from_pretrained
            f = self.path / fname
            if not f.is_file():
                continue
            if not fname.endswith(".index.json"):
                return {k: f for k in self._handle(f).keys()}
            try:  # a sharded checkpoint: its index maps each tensor to its file
                weight_map = json.loads(f.read_text())["weight_map"]
                return {k: self.path / v for k, v in weight_map.items()}
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                raise ConfigError(f"{self.flag}: {f} is unreadable ({type(exc).__name__}: {exc})") from None
        raise ConfigError(f"{self.flag}: {self.path} has no model.safetensors, pytorch_model.bin or the index of "
                          "either's shards; save the model with save_pretrained")

    def _handle(self, f: Path):
        if f not in self._open:
            try:
                if f.suffix == ".bin":
                    self._open[f] = torch.load(f, map_location="cpu", mmap=True, weights_only=True)
                else:
                    from safetensors import safe_open
                    self._open[f] = safe_open(str(f), framework="pt")
            except Exception as exc:  # a corrupt file: any of several libraries' errors
                raise ConfigError(f"{self.flag}: {f} is unreadable ({type(exc).__name__}: {exc})") from None
        return self._open[f]

    def _find(self, name: str):
        f = self._files.get(name) or self._files.get(name.removeprefix("transformer."))  # gpt2's hub files
        if f is None:
            raise ConfigError(f"{self.flag}: {self.path} has no tensor {name!r}; is it a {self.hf.get('model_type')} "
                              "model saved with save_pretrained?")
        h = self._handle(f)
        return h, name if name in h.keys() else name.removeprefix("transformer.")

    def read(self, name: str) -> torch.Tensor:
        h, key = self._find(name)
        return h[key] if isinstance(h, dict) else h.get_tensor(key)

    def sliced(self, name: str):
        """(an object that `[...]` reads a block of, without reading the rest; its shape)."""
        h, key = self._find(name)
        if isinstance(h, dict):  # torch.load(mmap=True): indexing reads the pages it touches
            return h[key], tuple(h[key].shape)
        part = h.get_slice(key)
        return part, tuple(part.get_shape())

    def part(self, cfg: ModelConfig, name: str, shape: tuple):
        """(transformers' name, Layout, a sliceable view) of the tensor that trident's parameter
        `name` of `shape` comes from; ConfigError where its shape (the file's header: no tensor is
        read) does not make that parameter."""
        hf, layout = source(cfg, name)
        part, hf_shape = self.sliced(hf)
        if layout.shape(hf_shape) != tuple(shape):
            raise ConfigError(f"{self.flag}: {self.path}: {hf} has shape {hf_shape}, which does not make the "
                              f"model's {name} of shape {tuple(shape)}; its config.json does not describe these "
                              "weights: save the model again with save_pretrained")
        return hf, layout, part

    def check(self, cfg: ModelConfig, seq_len: int) -> None:
        """ConfigError unless this directory's weights are those of `cfg`, trained at `seq_len`."""
        where, hf, mt = self.path / "config.json", self.hf, self.hf.get("model_type")
        if mt not in WEIGHT_TYPES:
            raise ConfigError(f"{self.flag}: {where}: the runtime cannot load {mt} weights (its blocks differ from "
                              f"trident's llama and gpt blocks); use a model of type {', '.join(WEIGHT_TYPES)}")
        rope_type = rope_parameters(hf).get("rope_type") or rope_parameters(hf).get("type") or "default"
        if mt != "gpt2" and rope_type not in ("default", *ROPE_SCALINGS):
            raise ConfigError(f"{where}: rope type {rope_type!r} (rope_scaling or rope_parameters); the runtime's "
                              f"rotary embeddings scale as {' or '.join(ROPE_SCALINGS)} only, so these weights would compute another model")
        act = hf.get("activation_function", "gelu_new") if mt == "gpt2" else hf.get("hidden_act", "silu")
        if act not in (GELUS if mt == "gpt2" else ("silu",)):
            key = "activation_function" if mt == "gpt2" else "hidden_act"
            raise ConfigError(f"{where}: {key}: {act!r}; the runtime computes "
                              f"{'GELU, exact or tanh (' + ', '.join(GELUS) + ')' if mt == 'gpt2' else 'SwiGLU (silu)'} only")
        sliding = mt in ("mistral", "mixtral") or hf.get("use_sliding_window") or "sliding_attention" in (hf.get("layer_types") or ())
        window = hf.get("sliding_window") if sliding else None
        if window is not None and window < seq_len:
            raise ConfigError(f"{where}: sliding_window: {window} is below the plan's seq_len {seq_len}; the runtime "
                              f"attends over whole sequences: plan with --seq-len {window} or less")
        mine = dataclasses.asdict(self.config)  # every field (to_dict leaves some out at their defaults)
        for field, value in dataclasses.asdict(cfg).items():
            if field == "name" or (field == "seq_len" and cfg.arch == "llama"):  # llama: any length
                continue
            if mine.get(field) != value:
                raise ConfigError(f"{self.flag}: {where} has model.{field} = {mine.get(field)!r}, the plan "
                                  f"{value!r}; plan with --model {where}")
        wanted = {source(cfg, n)[0] for n in parameter_names(cfg)}
        missing = sorted(n for n in wanted if n not in self._files and n.removeprefix("transformer.") not in self._files)
        if missing:
            raise ConfigError(f"{self.flag}: {self.path} lacks {missing[0]}"
                              f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}; is it a whole "
                              "model saved with save_pretrained?")
        extra = sorted(n for n in self._files if n not in wanted and f"transformer.{n}" not in wanted
                       and not n.endswith(_NOT_WEIGHTS))
        if extra:
            raise ConfigError(f"{self.flag}: {self.path} has weights trident's model has no place for: "
                              f"{', '.join(extra[:3])}{f' and {len(extra) - 3} more' if len(extra) > 3 else ''}")
        for name, shape in parameter_shapes(cfg).items():  # what each rank's HFInit checks of its tensors
            self.part(cfg, name, shape)


class HFInit:
    """runtime.model.init_weights' source for --init-from: a plain parameter gets its full tensor,
    a DTensor parameter the block of it this rank holds, read alone where its placements are
    plain shards (`local`), so a rank reads its slices of the model, not the model."""

    def __init__(self, cfg: ModelConfig, model_dir: ModelDir):
        self.cfg, self.dir = cfg, model_dir
        self.counts = {"whole": 0, "sliced": 0}

    def __call__(self, name: str, shape: tuple) -> torch.Tensor:
        hf, layout, _ = self.dir.part(self.cfg, name, shape)
        self.counts["whole"] += 1
        return self._finite(hf, layout.full(self.dir.read(hf)))

    def _finite(self, hf: str, t: torch.Tensor | None) -> torch.Tensor | None:
        """`t`, unless it holds NaN or infinities (the first step's loss would be NaN, read as divergence)."""
        if t is not None and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ConfigError(f"--init-from: {self.dir.path}: {hf} holds NaN or infinite values; these weights "
                              "cannot train: give a sound copy")
        return t

    def local(self, name: str, shape: tuple, mesh, placements) -> torch.Tensor | None:
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        if not all(type(p) is Shard or isinstance(p, Replicate) for p in placements):  # FSDP2's strided shards
            return None
        hf, layout, part = self.dir.part(self.cfg, name, shape)
        size, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
        block = layout.block(part, offset, size) if all(size) else None
        if block is not None:
            self.counts["sliced"] += 1
        return self._finite(hf, block)

    def record(self) -> dict:
        """For run.json: the directory, and how many tensors this rank read whole and in slices."""
        return {"path": str(self.dir.path), **self.counts}


def initial_weights(args, plan) -> HFInit | None:
    """--init-from: the source of runtime.model.init_weights (HFInit); None without the flag or
    where a checkpoint is resumed (it holds the model already)."""
    from runtime.checkpoint import checkpoints
    path = getattr(args, "init_from", None)
    if not path or (args.resume and args.checkpoint_dir and checkpoints(args.checkpoint_dir)):
        return None
    model_dir = ModelDir(path)
    model_dir.check(plan.model, plan.training.seq_len)
    return HFInit(plan.model, model_dir)


def parameter_names(cfg: ModelConfig) -> list[str]:
    return list(parameter_shapes(cfg))


def parameter_shapes(cfg: ModelConfig) -> dict[str, tuple]:
    """Each parameter of the runtime's model of `cfg` (tied ones under both names) and its shape."""
    from runtime.model import Transformer
    with torch.device("meta"):
        return {n: tuple(p.shape) for n, p in Transformer(cfg).named_parameters(remove_duplicate=False)}
