"""Dynamic loss scaling for fp16 (Micikevicius et al. 2018, "Mixed Precision Training", section
3.2), with torch.amp.GradScaler's defaults (initial scale 2^16, halved on an overflow, doubled after
2,000 steps without one): the loss is multiplied by the scale before the backward so that small
gradients survive fp16, the gradients are divided by it before clipping and the optimizer step,
and a step whose gradients overflowed (an inf or NaN norm) is skipped by every rank alike (the
norm is summed over all of them: runtime.optim.clip_grad_norm) and the scale halved. Megatron-LM's
DynamicGradScaler does the same. bf16 and fp32 need none: the scale stays 1."""
from __future__ import annotations

import argparse
import math

INITIAL = 2.0 ** 16
GROWTH_INTERVAL = 2000
INITIAL_RANGE = (1.0, 2.0 ** 32)  # --initial-loss-scale: beyond, fp16's gradients (or float32's) under- or overflow


def initial_scale(text: str) -> float:
    """--initial-loss-scale, as runtime.train and `trident run` parse it: a number in INITIAL_RANGE."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    low, high = INITIAL_RANGE
    if not low <= v <= high:  # NaN included
        raise argparse.ArgumentTypeError(f"{text} is outside {low:g} to 2^32 ({high:.0f}), where the scaled loss and "
                                         f"gradients would under- or overflow; give a power of two in that range "
                                         f"(default 2^16, torch's GradScaler's)")
    return v


class LossScale:
    def __init__(self, enabled: bool, initial: float = INITIAL):
        self.enabled = enabled
        self.scale = initial if enabled else 1.0
        self.good_steps = 0  # since the last overflow or growth

    def update(self, norm: float) -> bool:
        """After a step's backward, its gradient norm (of the unscaled gradients): whether the
        optimizer may step. An overflow halves the scale and skips the step."""
        if not self.enabled:
            return True
        if not math.isfinite(norm):
            self.scale, self.good_steps = self.scale / 2, 0
            return False
        self.good_steps += 1
        if self.good_steps == GROWTH_INTERVAL:
            self.scale, self.good_steps = self.scale * 2, 0
        return True

    def state(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load(self, state: dict | None) -> None:
        if self.enabled and state:
            self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
