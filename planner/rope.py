"""Rotary embedding scaling, a model field (planner.model.ModelConfig.rope_scaling)."""
from __future__ import annotations

from dataclasses import dataclass

from planner.values import ConfigError, checked, is_int, is_real

ROPE_SCALINGS = ("linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """Rotary embeddings stretched beyond the sequences a model was pre-trained on (the runtime
    computes them; the costs do not change): "linear" divides every frequency by `factor`
    (position interpolation, Chen et al. 2023, transformers' rope_type "linear"); "llama3" is
    Llama 3.1's (Meta's reference model, transformers' rope_type "llama3"): wavelengths above
    original_max_position_embeddings / low_freq_factor are divided by `factor`, those below
    original_max_position_embeddings / high_freq_factor kept, those between interpolated."""

    type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    OBJECT = "type and factor"  # what a plan file's object of it holds at least (planner.values.checked)

    def check(self, where: str = "model.rope_scaling") -> None:
        def need(cond, fld, msg):
            if not cond:
                raise ConfigError(f"{where}.{fld}: {msg}")
        need(self.type in ROPE_SCALINGS, "type", f"is {self.type!r}; use one of {', '.join(ROPE_SCALINGS)}")
        for f in ("factor", "low_freq_factor", "high_freq_factor"):
            v = getattr(self, f)
            need(is_real(v) and v > 0, f, f"is {v!r}; it must be a positive number")
        need(self.high_freq_factor > self.low_freq_factor, "high_freq_factor",
             f"is {self.high_freq_factor!r}; it must be above low_freq_factor ({self.low_freq_factor!r})")
        v = self.original_max_position_embeddings
        need(is_int(v) and v > 0, "original_max_position_embeddings", f"is {v!r}; it must be a positive integer")

    @classmethod
    def from_dict(cls, d, where: str = "model.rope_scaling") -> "RopeScaling":
        return checked(cls, d, where)
