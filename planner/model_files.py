"""What `--model` names: a zoo model, a trident model JSON, or a Hugging Face config.json."""
from __future__ import annotations

from pathlib import Path

from planner.model import ConfigError, ModelConfig
from planner.values import is_one_line
from planner.zoo import ZOO


def load_model(spec: str) -> ModelConfig:
    """A zoo name, a path to a trident model JSON, or a path to a Hugging Face config.json (or to
    the model directory holding it)."""
    if spec in ZOO:
        return ZOO[spec]
    if not spec.strip():
        raise ConfigError(f"--model: an empty value; give a zoo model ({', '.join(ZOO)}) or a JSON file")
    path = Path(spec)
    if path.is_dir() and (path / "config.json").is_file():
        path = path / "config.json"
    if not path.exists():
        raise ConfigError(f"--model: {spec!r} is neither a zoo model ({', '.join(ZOO)}) nor a file")
    from planner.profile_checks import read_json  # it imports this module
    _, data = read_json(path, "--model")
    if isinstance(data, dict) and "model_type" in data:
        name = path.resolve().parent.name if path.name == "config.json" else path.stem
        from planner.hf_config import from_hf_config
        return from_hf_config(data, name=_named(name, "hf-model"), where=str(path))
    if isinstance(data, dict) and "name" not in data:
        data = {"name": _named(path.stem, "model"), **data}
    return ModelConfig.from_dict(data, where=str(path))


def _named(name: str, default: str) -> str:
    """A name taken from a file or directory name, or `default` where that is no printable line."""
    return name if is_one_line(name) else default
