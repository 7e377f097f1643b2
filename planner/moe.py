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
- each expert's products at the rate of a product as tall as all the routed rows together, as one
  grouped product runs them (torch._grouped_mm, Megatron-Core's GroupedGEMM); the runtime's loop
  over the experts (runtime.moe) runs a product an expert, each of tokens x k / experts rows, and
  pays a launch each on a GPU, which this does not price;
- each expert split by tensor parallelism the Megatron-LM way, the first projections by columns,
  the second by rows, one all-reduce (or reduce-scatter under sequence parallelism) after the
  weighted sum, as a dense MLP's;
- without expert parallelism (mesh.ep 1) the experts are held as the other weights are: every
  expert on every data-parallel rank, FSDP and ZeRO sharding them with the rest. With it (mesh.ep
  = ep > 1; GShard, Lepikhin et al. 2021; Megatron-LM and torchtitan spread experts over the
  data-parallel ranks so) each rank of an EP group (ep consecutive dp coordinates) holds experts /
  ep of them, ZeRO shards those over the ranks holding the same ones (dp / ep x cp: the expert
  shard group) and their gradients reduce over that group alone; each block sends each token
  once to each rank holding any of its experts (as DeepEP does; ranks_per_token of them, k where
  a rank holds one expert) and the weighted sums of those experts' outputs back, two all-to-alls
  forward and two backward (two more, the replayed forward's, under full recomputation), every
  TP rank its own (it computes whole rows); the experts' products are priced as before (a rank
  runs experts / ep experts of ep times the rows). The runtime runs it so (runtime.moe), under
  ZeRO 1-3; before each dispatch it exchanges the token counts (an all-to-all of ep int64
  counts, a latency), priced with the forward's two (the replay's too);
- the router and the shared expert's gate are replicated on the TP ranks, like the norms;
- the eager operations that route (the router's float32 softmax, the top-k, the gather of each
  token's rows for its experts and the weighted scatter back) as the runtime's block runs them
  (routing_bytes), under expert parallelism with its exchange's local copies (dispatch_bytes),
  what it keeps for the backward as it keeps it (activation_parts).
"""
from __future__ import annotations

from dataclasses import dataclass

from planner.values import ConfigError, checked, is_int


@dataclass(frozen=True)
class MoESpec:
    experts: int  # routed experts in each block
    experts_per_token: int  # k: the experts each token goes through
    shared_ffn_hidden: int = 0  # width of the shared expert's SwiGLU MLP; 0: none
    # the top k probabilities renormalized to sum to 1 (Mixtral; Hugging Face's norm_topk_prob),
    # else weighted as they are (Qwen1.5-MoE, Qwen2-MoE)
    normalize_top_k: bool = True
    OBJECT = "experts and experts_per_token"  # what a plan file's object of it holds at least (planner.values.checked)

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
        need(isinstance(self.normalize_top_k, bool), "normalize_top_k", f"is {self.normalize_top_k!r}; it must be "
             "true or false")

    @classmethod
    def from_dict(cls, d, where: str = "model.moe") -> "MoESpec":
        return checked(cls, d, where)


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
    """Bytes per token an MoE block of the runtime (runtime.moe) keeps for its backward beyond a
    dense block's norm and projection inputs, as (whole: on each TP rank, sequence parallelism or
    not, since the router and the experts read the MLP input gathered whole; sharded: split tp
    ways). A dense block's SwiGLU keeps 4 ffn_hidden (gate output, its silu, up output, their
    product: sharded); an MoE block keeps that for each of its k rows and for the shared expert,
    and: the router's float32 probabilities (its softmax's output), the top-k indices (int64) and
    probabilities and their sum (float32: the renormalization's division, where renormalized), the
    rows' token and expert order (int64), the gathered rows the experts read, the experts' outputs and their
    weights (the product's backward reads both), the weighted outputs (index_add's backward keeps
    its source), and with a shared expert its output and its gate's (the product's).
    Traced with saved-tensor hooks in tests/test_moe.py."""
    k, h = m.moe.experts_per_token, m.hidden
    whole = 4.0 * m.moe.experts + 8 * k + 2 * 8 * k + e * k + 3.0 * e * k * h
    if m.moe.normalize_top_k:  # the division keeps the top k and their sum
        whole += 4 * k + 4
    if m.moe.shared_ffn_hidden:
        whole += e * h + e
    return whole, 4.0 * e * ffn_width(m)


def routing_bytes(m, e: int) -> tuple[float, float]:
    """(forward, backward) bytes per token the eager routing of the runtime (runtime.moe) moves on
    one TP rank, beyond a dense block's SwiGLU kernels (planner.pointwise counts those for
    ffn_width columns). Forward, per token of n experts, k rows, hidden h: the router's logits cast
    to float32 (none in float32) and their softmax; the top-k, its renormalization (a sum, a
    division) and the weights cast back; the rows sorted by expert (argsort, bincount, the division
    by k that gives each row's token); the gather of the rows and of their weights; the experts'
    outputs concatenated, scaled by their weights and added into a zeroed output (index_add_). The
    backward moves each one's gradients: the softmax's and the top-k's (a scatter), the
    renormalization's, the scatter-add's (a gather of the rows' gradients), the product's two, the
    split's (a concatenation), the gather's (index_put into zeros) and the added gradients of the
    rows. With a shared expert: its gate's sigmoid, the product with it and the add of the two
    outputs, forward and backward. Traced op by op on the runtime's block (tests/test_moe.py)."""
    n, k, h = m.moe.experts, m.moe.experts_per_token, m.hidden
    cast = 0 if e == 4 else e + 4
    fwd = 12 * n + cast * (n + k) + 68 * k + 3 * e * k + 7 * e * k * h + 3 * e * h
    bwd = 20 * n + cast * (n + k) + 44 * k + 6 * e * k + 14 * e * k * h + 3 * e * h
    if m.moe.normalize_top_k:  # the sum and the division, their backward (the sum's none over one row)
        fwd += 12 * k + 8
        bwd += 56 * k + 12 + (4 * k + 4 if k > 1 else 0)
    if m.moe.shared_ffn_hidden:
        fwd += 5 * e * h + 3 * e
        bwd += 15 * e * h + 5 * e  # the product's two and the gate's sum, three more gradient adds
    return fwd, bwd


def weight_grad_outputs(m) -> tuple[float, float]:
    """(column-split, whole) elements per token of the feed-forward part's product outputs whose
    gradients its weight gradients start from (ModelConfig.weight_grad_inputs_per_token): the
    gate and up projections' (k rows each with experts), the second projections' (whole on each
    TP rank, row-parallel), the router's and the shared gate's."""
    k, h, fs = m.moe.experts_per_token, m.hidden, m.moe.shared_ffn_hidden
    return 2.0 * ffn_width(m), k * h + m.moe.experts + ((h + 1) if fs else 0)


def held_experts(m, kind: str, tp: int, ep: int) -> float:
    """Parameters of a layer's experts one rank holds where expert parallelism spreads them
    (ep > 1: experts / ep of them, split tp ways), else 0 (held as the layer's other weights)."""
    if ep == 1 or kind != "block" or m.moe is None:
        return 0.0
    return m.moe.experts // ep * 3 * m.hidden * m.ffn_hidden / tp


def expert_load(plan, kind: str) -> float:
    """How many more routed rows than the mean the busiest rank of an EP group computes, as a
    fraction of the mean (0: balanced; module doc): training.moe_load_factor is the busiest
    expert's rows over the mean, the rank holding it taken to have its other experts at the mean,
    and no rank receives more than min(k, experts / ep) rows a token. 0 without expert parallelism,
    where every rank computes all the rows of its own tokens whatever their routing."""
    m, ep = plan.model, plan.mesh.ep
    if ep == 1 or kind != "block" or m.moe is None:
        return 0.0
    k, per = m.moe.experts_per_token, m.moe.experts // ep  # experts a rank holds
    rank = (plan.training.moe_load_factor + per - 1) / per
    return min(rank, ep * min(k, per) / k) - 1.0


def expert_load_costs(plan, kind: str, b: float, s: int, e: int, gemm_s, pointwise_s) -> tuple:
    """(forward s, backward s, of it weight-gradient s, kept bytes) an MoE block's busiest EP rank
    spends beyond a balanced one (expert_load): its experts' products (ffn_gemms, timed by
    `gemm_s`), their SwiGLU's kernels (planner.pointwise's bytes an element, eager or fused, timed
    by `pointwise_s`), and what they keep for the backward (activation_parts: the rows the experts
    read, whole on each TP rank, and SwiGLU's four tensors) for that many more rows."""
    extra = expert_load(plan, kind)
    if not extra:
        return 0.0, 0.0, 0.0, 0.0
    from planner.pointwise import swiglu_bytes
    m, tp = plan.model, plan.mesh.tp
    k, f = m.moe.experts_per_token, m.ffn_hidden
    mm = sum(gemm_s(*g) for g in ffn_gemms(m, b * s, tp)[:2])  # the experts' products
    elements = b * s * k * f / tp
    pw_f, pw_b = swiglu_bytes(plan.training.elementwise_kernels, e)
    kept = b * s * k * (e * m.hidden + 4.0 * e * f / tp)
    return (extra * (mm + pointwise_s(pw_f * elements)), extra * (2 * mm + pointwise_s(pw_b * elements)),
            extra * mm, extra * kept)


def ranks_per_token(m, ep: int) -> float:
    """The ranks of an EP group of `ep` a token goes to: those holding any of its k experts (a
    rank holds experts / ep consecutive ones), expected over k distinct experts drawn uniformly
    (balanced routing, each expert equally likely in every token's choice): ep (1 - C(n - n / ep,
    k) / C(n, k)). k where a rank holds one expert; fewer where a token's experts share ranks
    (Qwen3-30B-A3B, 128 experts, k 8, over 8 ranks: 5.34)."""
    from math import comb
    n, k = m.moe.experts, m.moe.experts_per_token
    return ep * (1.0 - comb(n - n // ep, k) / comb(n, k))


def dispatch_bytes(m, e: int, ep: int, ranks: float | None = None) -> tuple[float, float, float]:
    """(forward, backward, kept) bytes per token the runtime's expert-parallel exchange moves, and
    keeps for the backward, on a rank beyond routing_bytes and activation_parts
    (runtime.moe.MoEFeedForward._expert_parallel; the all-to-alls themselves are communication:
    expert_parallel_comm; planner.layers.layer_cost prices it), r the ranks a token reaches
    (`ranks`, else ranks_per_token), p = experts / ep: forward, the token's r rows gathered
    (2 r h e) with their p weights and choices (4 r p e) and concatenated (2 r (h + 2 p) e), the
    receiver's zeroed sums (r h e) and its index-add over r rows a token where one process adds
    into one (2 (r - 1) h e), the sender's index-add of the r sums into the token ((2 + r) h e):
    8 r (h + p) e. Backward: the gather's scatter into zeros ((3 + r) h e), the split's
    concatenation (2 r (h + 2 p) e), the sender's index-add's gather (2 r h e), the experts' rows
    gathered from r rows a token where one process gathers from one (3 (r - 1) h e):
    (8 r h + 4 r p) e. A few bytes a token per expert (the choices' scatters, nonzero) and the
    int64 indices (about 35 bytes a row beyond a token's first) are left out: traced at r = 1 to
    3, tests/test_moe.py. Kept: the r sums received back, which the sender's index-add keeps
    (autograd keeps an index-add's source), and their token indices (int64, in one storage with
    their ranks': nonzero's): r (h e + 16). Zeros without expert parallelism."""
    if m.moe is None or (ep == 1 and ranks is None):
        return 0.0, 0.0, 0.0
    r = ranks_per_token(m, ep) if ranks is None else ranks
    p, h = m.moe.experts // ep, m.hidden
    return 8 * r * (h + p) * e, (8 * r * h + 4 * r * p) * e, r * (h * e + 16)


def expert_parallel_comm(cluster, plan, kind: str, recompute: str, tp_ranks) -> tuple[float, float]:
    """(forward, backward) seconds of a block's expert-parallel all-to-alls on one rank per
    micro-batch (module doc) over the EP group of the rank leading `tp_ranks`: the token counts'
    exchange, the dispatch (each token once to each rank holding any of its experts,
    ranks_per_token, with the experts' weights and choices of that rank: hidden + 2 experts / ep
    elements) and the combine (the weighted sums back, hidden elements); the backward's two, and a
    full recomputation's forward again. Zeros without expert parallelism."""
    m, t, mesh = plan.model, plan.training, plan.mesh
    if mesh.ep == 1 or kind != "block" or m.moe is None:
        return 0.0, 0.0
    from planner.plan import DTYPES
    rows = t.micro_batch / mesh.cp * t.seq_len * ranks_per_token(m, mesh.ep)
    group = mesh.expert_group(**mesh.coords(tp_ranks[0]))
    e, width = DTYPES[t.dtype], m.hidden + 2 * m.moe.experts // mesh.ep
    # the busiest rank receives the most rows in a dispatch and sends the most back (expert_load)
    busy = 1 + expert_load(plan, kind)
    dispatch, combine = (cluster.collective_time("all_to_all", e * rows * w, group) * busy for w in (width, m.hidden))
    forward = dispatch + combine + cluster.collective_time("all_to_all", 8 * mesh.ep, group)  # the counts first
    return forward, dispatch + combine + (forward if recompute == "full" else 0.0)


def largest_ffn_param(m, tp: int) -> float:
    """Elements of the largest feed-forward parameter on one TP rank: a projection of the MLP, of
    an expert or of the shared expert (each expert holds its own, runtime.moe)."""
    return m.hidden * max(m.ffn_hidden, m.moe.shared_ffn_hidden if m.moe is not None else 0) / tp
