"""`trident export CHECKPOINT -o DIR`: a checkpoint's model as a transformers model directory.

CHECKPOINT is a --checkpoint-dir (its newest step) or one step-K directory in it. DIR gets
config.json (planner.hf_config.to_hf_config) and the weights in safetensors files of at most
--max-shard-gb each, with model.safetensors.index.json where there are several (transformers'
save_pretrained layout): `AutoModelForCausalLM.from_pretrained(DIR)` loads it, and `trident run
--init-from DIR` starts a run of any plan from it. One process, no process group: the layers are
read from the checkpoint's DCP shards a file's worth at a time, so memory holds one output file,
whatever plan wrote the checkpoint. The optimizer state stays behind.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import warnings
from pathlib import Path

import torch

from planner.args import OneLineParser
from planner.hf_config import HF_DTYPES, dense_type, moe_type, to_hf_config
from planner.model import ConfigError, ModelConfig
from runtime.checkpoint import META, checkpoints, shard_metadata
from runtime.hf_weights import parameter_shapes, to_hf
from runtime.tied import head_weight

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# what save_pretrained writes for a tokenizer (fast and slow), and the generation defaults
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json")
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def tokenizer_files(directory: Path) -> tuple[list[Path], dict]:
    """--tokenizer: the tokenizer files of a model directory, and its config.json's token ids."""
    files = [directory / f for f in TOKENIZER_FILES if (directory / f).is_file()]
    if not any(f.name != "generation_config.json" for f in files):
        raise ConfigError(f"--tokenizer: {directory} holds no tokenizer files ({', '.join(TOKENIZER_FILES[:4])}, ...); "
                          "give the model directory the run started from")
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    return files, {k: config[k] for k in TOKEN_IDS if isinstance(config, dict) and config.get(k) is not None}


def parse_args(argv=None) -> argparse.Namespace:
    ap = OneLineParser(prog="trident export", description=__doc__.splitlines()[0].split(": ", 1)[1])
    ap.add_argument("checkpoint", help="a --checkpoint-dir (its newest checkpoint) or a step-K directory")
    ap.add_argument("-o", "--out", required=True, help="the model directory to write")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="fp32",
                    help="the weights' dtype (default fp32: the master weights as trained)")
    ap.add_argument("--max-shard-gb", type=float, default=5.0, help="the largest safetensors file (default 5 GB)")
    ap.add_argument("--tokenizer", default=None, metavar="DIR",
                    help="a model directory whose tokenizer files and token ids the export gets (the one the run "
                         "started from)")
    ap.add_argument("--force", action="store_true", help="write into a directory that is not empty")
    return ap.parse_args(argv)


def step_dir(path: Path) -> Path:
    if (path / META).is_file():
        return path
    found = checkpoints(path)
    if not found:
        raise ConfigError(f"{path}: no checkpoint there (neither {META} nor step-K directories); give a "
                          "--checkpoint-dir of trident run or one of its step-K directories")
    return found[-1]


def read_run(ckpt: Path) -> tuple[ModelConfig, dict, int]:
    """The checkpoint's model, training settings and step, from its trident.json."""
    try:
        meta = json.loads((ckpt / META).read_text())
        run, step = meta["run"], int(meta["step"])
        cfg = ModelConfig.from_dict({"name": ckpt.parent.name or "trident", **run["model"]}, where=f"{ckpt / META}: run.model")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{ckpt / META}: unreadable or corrupt ({type(exc).__name__}: {exc}); export another "
                          "checkpoint") from None
    return cfg, run.get("training") or {}, step


def shards(sizes: dict[str, int], limit: float) -> list[list[str]]:
    """Parameter names in groups of whole layers, each under `limit` bytes where a layer allows."""
    groups, size = [[]], 0
    by_layer: dict[int, list[str]] = {}
    for n in sizes:
        by_layer.setdefault(int(n.split(".")[1]), []).append(n)
    for layer in sorted(by_layer):
        nbytes = sum(sizes[n] for n in by_layer[layer])
        if groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1] += by_layer[layer]
        size += nbytes
    return groups


def export(src: Path, out: Path, dtype: str = "fp32", max_shard_bytes: float = 5e9, force: bool = False,
           tokenizer: Path | None = None) -> dict:
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException: each rank's failures

    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise ConfigError(f"-o: {out} exists and is not an empty directory; choose another or pass --force")
    tok_files, token_ids = tokenizer_files(tokenizer) if tokenizer is not None else ([], {})
    ckpt = step_dir(src)
    cfg, training, step = read_run(ckpt)
    if cfg.arch == "llama":  # a model transformers computes (Llama, Qwen2, Qwen3 and their MoE kin), else one line
        moe_type(cfg) if cfg.moe is not None else dense_type(cfg)
    reader = dcp.FileSystemReader(str(ckpt))
    saved = shard_metadata(ckpt, "export another step").state_dict_metadata  # a torn .metadata or .distcp: one line
    shapes = parameter_shapes(cfg)
    names = [n for n in shapes if not (cfg.tie_embeddings and n == head_weight(cfg))]  # a tied head is the embedding
    absent = [n for n in names if f"model.{n}" not in saved]
    if absent:
        raise ConfigError(f"{ckpt}: the checkpoint lacks model.{absent[0]}"
                          f"{f' and {len(absent) - 1} more' if len(absent) > 1 else ''}; it is not a whole "
                          "checkpoint of this model")
    other = [n for n in names if tuple(saved[f"model.{n}"].size) != shapes[n]]
    if other:  # trident.json's run.model is not the model these tensors are of
        n = other[0]
        raise ConfigError(f"{ckpt}: the checkpoint's model.{n} is {list(saved[f'model.{n}'].size)}, where the model "
                          f"{META} describes has {list(shapes[n])}; the checkpoint is corrupt or another model's")
    elem = DTYPES[dtype].itemsize
    sizes = {n: elem * torch.Size(saved[f"model.{n}"].size).numel() for n in names}
    groups = shards(sizes, max_shard_bytes)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("model*.safetensors*"):  # --force: an earlier export's files would mix in
        stale.unlink()
    weight_map, total = {}, 0
    for k, group in enumerate(groups):
        fname = "model.safetensors" if len(groups) == 1 else f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        state = {f"model.{n}": torch.empty(saved[f"model.{n}"].size, dtype=saved[f"model.{n}"].properties.dtype)
                 for n in group}
        with warnings.catch_warnings():  # "no process group: loading in one process", as meant
            warnings.simplefilter("ignore")
            try:
                dcp.load(state, storage_reader=reader)
            except (Exception, CheckpointException) as exc:  # noqa: BLE001 (a missing, truncated or torn .distcp)
                if created:
                    shutil.rmtree(out, ignore_errors=True)
                raise ConfigError(f"{ckpt}: its tensor files cannot be read ({type(exc).__name__}); the checkpoint "
                                  "is incomplete or corrupt: export another step") from None
        hf = {k2: v.to(DTYPES[dtype]).contiguous() for k2, v in
              to_hf(cfg, {n: state[f"model.{n}"] for n in group}).items()}
        save_file(hf, str(out / fname), metadata={"format": "pt"})
        weight_map.update({k2: fname for k2 in hf})
        total += sum(v.numel() * v.element_size() for v in hf.values())
    config = to_hf_config(cfg, dtype, training.get("dropout") or 0.0, training.get("attention_dropout_p") or 0.0)
    if cfg.arch == "gpt" and cfg.vocab <= 50256:  # GPT2Config's token ids (50256) would lie outside
        config.update(bos_token_id=None, eos_token_id=None)
    config.update(token_ids)  # the tokenizer's own
    for f in tok_files:
        shutil.copyfile(f, out / f.name)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if len(groups) > 1:
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
    return {"checkpoint": str(ckpt), "step": step, "files": len(groups), "bytes": total,
            "tensors": len(weight_map), "config": config, "tokenizer_files": len(tok_files)}


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
        if not args.max_shard_gb > 0:
            raise ConfigError(f"--max-shard-gb: {args.max_shard_gb} must be positive")
        done = export(Path(args.checkpoint), Path(args.out), args.dtype, args.max_shard_gb * 1e9, args.force,
                      None if args.tokenizer is None else Path(args.tokenizer))
    except ConfigError as exc:
        print(f"trident: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a full disk, a directory that cannot be written
        print(f"trident: error: -o: cannot write {exc.filename or args.out} ({exc.strerror or exc})", file=sys.stderr)
        return 2
    arch = done["config"]["architectures"][0]
    tok = f", {done['tokenizer_files']} tokenizer file(s)" if done["tokenizer_files"] else ""
    print(f"exported step {done['step']} of {done['checkpoint']}: {done['tensors']} tensors, "
          f"{done['bytes'] / 2**20:,.1f} MiB {HF_DTYPES[args.dtype]} in {done['files']} safetensors file(s), "
          f"config.json for {arch}{tok}, in {args.out}")
    print(f"load: transformers.AutoModelForCausalLM.from_pretrained({str(args.out)!r}); or start a run from it: "
          f"trident run PLAN --init-from {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
