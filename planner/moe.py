"""Mixture-of-experts blocks, a model field (planner.model.ModelConfig.moe).

An MoE block is a Llama block whose SwiGLU MLP is replaced by a router and `experts` SwiGLU MLPs
of ffn_hidden each: the router, a linear layer hidden -> experts, gives each token a softmax over
the experts, the token goes through the experts_per_token (k) most probable, and their outputs are
summed weighted by those probabilities (renormalized over the k) (Shazeer et al. 2017, "Outrageously
Large Neural Networks"; Fedus et al. 2022, Switch Transformer; Jiang et al. 2024, Mixtral of
Experts, section 2.1). With shared_ffn_hidden > 0 every token also goes through one shared SwiGLU
MLP of that width, scaled by a sigmoid gate hidden -> 1 (Qwen2-MoE's shared expert).

How the planner prices one (this module, used by planner.model and planner.pointwise):
- balanced routing: every expert computes tokens x k / experts of a micro-batch's tokens (what a
  load-balancing loss aims at, Fedus et al. 2022 eq. 4); the time a step loses to the most loaded
  expert is not priced, and no token is dropped (dropless, as Gale et al. 2023's MegaBlocks and
  Megatron-Core's default);
- each expert's products as one grouped product (torch._grouped_mm, Megatron-Core's GroupedGEMM):
  an expert's rows at the rate of a product as tall as all the routed rows together;
- the experts are held as the other weights are: every expert on every data-parallel rank (FSDP
  and ZeRO shard them with the rest), each split by tensor parallelism the Megatron-LM way, the
  first projections by columns, the second by rows, one all-reduce (or reduce-scatter under
  sequence parallelism) after the weighted sum, as a dense MLP's. Expert parallelism (experts
  spread over the data-parallel ranks, tokens sent to them by all-to-all) is not planned yet;
- the router and the shared expert's gate are replicated on the TP ranks, like the norms;
- the eager operations that route (the router's float32 softmax, the top-k, the gather of each
  token's rows for its experts and the weighted scatter back) are counted by hand
  (routing_bytes): trident's runtime has no MoE block yet to trace them against, and refuses
  MoE plans (runtime.run_checks).
"""
from __future__ import annotations

from dataclasses import dataclass

from planner.values import ConfigError, is_int, strict


@dataclass(frozen=True)
class MoESpec:
    experts: int  # routed experts in each block
    experts_per_token: int  # k: the experts each token goes through
    shared_ffn_hidden: int = 0  # width of the shared expert's SwiGLU MLP; 0: none

    def check(self, where: str = "model.moe") -> None:
        def need(cond, fld, msg):
            if not cond:
                raise ConfigError(f"{where}.{fld}: {msg}")
        need(is_int(self.experts) and 2 <= self.experts <= 100_000, "experts",
             f"is {self.experts!r}; it must be an integer from 2 to 100000 (a dense model has no moe field)")
        k = self.experts_per_token
        need(is_int(k) and 1 <= k <= self.experts, "experts_per_token",
             f"is {k!r}; it must be an integer from 1 to experts ({self.experts})")
        v = self.shared_ffn_hidden
        need(is_int(v) and 0 <= v <= 10_000_000, "shared_ffn_hidden",
             f"is {v!r}; it must be a non-negative integer (0: no shared expert)")

    @classmethod
    def from_dict(cls, d, where: str = "model.moe") -> "MoESpec":
        if not isinstance(d, dict):
            raise ConfigError(f"{where}: is {d!r}; expected null or an object with experts and experts_per_token")
        strict(cls, d, where)
        spec = cls(**d)
        spec.check(where)
        return spec


def ffn_params(m) -> tuple[int, int]:
    """(held, replicated on the TP ranks) parameters of an MoE block's feed-forward part: the
    router, the experts, the shared expert with its gate."""
    h, f = m.hidden, m.ffn_hidden
    shared = 3 * h * m.moe.shared_ffn_hidden + (h if m.moe.shared_ffn_hidden else 0)
    rep = h * m.moe.experts + (h if m.moe.shared_ffn_hidden else 0)  # the router, the shared gate
    return h * m.moe.experts + m.moe.experts * 3 * h * f + shared, rep


def ffn_active_params(m) -> int:
    """Matrix parameters of an MoE block's feed-forward part a token's products go through: the
    router, k experts and the shared expert with its gate."""
    h, f = m.hidden, m.ffn_hidden
    held, rep = ffn_params(m)
    return held - (m.moe.experts - m.moe.experts_per_token) * 3 * h * f


def ffn_width(m) -> int:
    """SwiGLU columns a token passes through: ffn_hidden, or k experts' and the shared expert's."""
    if m.moe is None:
        return m.ffn_hidden
    return m.moe.experts_per_token * m.ffn_hidden + m.moe.shared_ffn_hidden


def ffn_gemms(m, tokens: int, tp: int) -> list[tuple]:
    """An MoE block's feed-forward forward products on one TP rank as (count, M, N, K): the
    experts' first (gate and up) and second projections first, each as `experts` products of the
    balanced tokens x k / experts rows, then the router, the shared expert and its gate."""
    h, f = m.hidden, m.ffn_hidden
    n, rows = m.moe.experts, tokens * m.moe.experts_per_token / m.moe.experts
    out = [(2 * n, rows, f // tp, h), (n, rows, h, f // tp), (1, tokens, n, h)]
    fs = m.moe.shared_ffn_hidden
    if fs:
        out += [(2, tokens, fs // tp, h), (1, tokens, h, fs // tp), (1, tokens, 1, h)]
    return out


def activation_parts(m, e: int) -> tuple[float, float]:
    """Bytes per token an MoE block keeps for its backward beyond a dense block's norm and
    projection inputs, as (whole: on each TP rank, sequence parallelism or not, since the router
    and the experts read the MLP input gathered whole; sharded: split tp ways). A dense block's
    SwiGLU keeps 4 ffn_hidden (gate output, its silu, up output, their product: sharded); an MoE
    block keeps that for each of its k rows and for the shared expert, and: the router's float32
    probabilities (its softmax's output), the top-k indices (int64) and probabilities, the
    renormalized weights (float32), the gathered rows the experts read, the experts' outputs (the
    weights' gradient reads them), the shared expert's output and its gate's (which scales it)."""
    k, h = m.moe.experts_per_token, m.hidden
    whole = 4.0 * m.moe.experts + (8 + 4 + 4) * k + 2.0 * e * k * h
    if m.moe.shared_ffn_hidden:
        whole += e * h + e
    return whole, 4.0 * e * ffn_width(m)


def routing_bytes(m, e: int) -> tuple[float, float]:
    """(forward, backward) bytes per token the eager routing moves on one TP rank, beyond the
    SwiGLU kernels (planner.pointwise counts those for ffn_width columns): the router's logits cast
    to float32 and their softmax (read e, write 4; read 4, write 4 per expert), the top-k (read the
    probabilities, write k values and int64 indices), the renormalization (a sum, a division), the
    gather of each token's k rows (read and write k hidden), their outputs scaled by the weights
    (read, write), the scatter-add into the block's output (zero it, read each row, read and write
    the sum); with a shared expert its gate's sigmoid and product and the add of the two outputs.
    The backward moves each as BWD_ELEMENTWISE_FACTOR times (the gather's backward is a scatter-add,
    the scatter's a gather), plus the gradient adds of the MLP input's extra readers (the router,
    the gather, the shared expert's gate and up, a read and a write each beside the sum)."""
    from planner.pointwise import BWD_ELEMENTWISE_FACTOR
    n, k, h = m.moe.experts, m.moe.experts_per_token, m.hidden
    router = (e + 4) * n + 8 * n + (4 * n + 12 * k) + (4 * k + 4 + 8 * k)  # cast, softmax, top-k, renormalize
    rows = 2 * e * k * h + (2 * e * k * h + 4 * k) + (e * h + 3 * e * k * h)  # gather, scale, scatter-add
    fwd, readers = router + rows, 2
    if m.moe.shared_ffn_hidden:
        fwd += 2 * e + 2 * e * h + 3 * e * h  # the gate's sigmoid, the product, the add
        readers += 1
    return fwd, BWD_ELEMENTWISE_FACTOR * fwd + readers * 3 * e * h


def weight_grad_outputs(m) -> tuple[float, float]:
    """(column-split, whole) elements per token of the feed-forward part's product outputs whose
    gradients its weight gradients start from (ModelConfig.weight_grad_inputs_per_token): the
    gate and up projections' (k rows each with experts), the second projections' (whole on each
    TP rank, row-parallel), the router's and the shared gate's."""
    k, h, fs = m.moe.experts_per_token, m.hidden, m.moe.shared_ffn_hidden
    return 2.0 * ffn_width(m), k * h + m.moe.experts + ((h + 1) if fs else 0)


def largest_ffn_param(m, tp: int) -> float:
    """Elements of the largest feed-forward parameter on one TP rank: a projection, or an MoE
    block's experts' projections held as one [experts, ...] tensor (grouped products' layout)."""
    return m.hidden * m.ffn_hidden * (m.moe.experts if m.moe is not None else 1) / tp
