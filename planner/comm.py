"""The collectives trident's runtime issues, priced on a cluster (planner.cluster): tensor-parallel
communication per layer, the gradient-norm reductions of clipping and the per-step
synchronization. planner.cost adds them up."""
from __future__ import annotations

import math

import numpy as np

from planner.cluster import ClusterSpec
from planner.model import LOSS_CHUNKS

# Share of an all-reduce running beside a GEMM that the overlap hides (training.async_tp_allreduce).
# Not all of it: the NCCL kernel and the GEMM share the GPU's SMs. Derived from Korthikanti et al.
# 2022, Table 4 (one 22B layer on A100, Megatron-LM with the asynchronous all-reduce on by default):
# the three rows without sequence parallelism (19.6, 27.2, 20.9 ms forward + backward) lie 1.42,
# 1.75 and 1.26 ms below this model without overlap, of the 2.04 ms that perfect overlap would hide:
# 0.69, 0.85, 0.62, mean 0.72 (tests/test_cost.py recomputes it). It absorbs the model's own error
# on those rows (+2 to +3% on the rows without overlap). Measured on A100 only; used for every device.
ASYNC_TP_HIDDEN = 0.72

SCALAR_BYTES = 8.0  # one float64 partial sum or loss


def tp_comm(cluster: ClusterSpec, kind: str, act_bytes: float, sp: bool, tp_ranks: list, b: int, s: int,
            regather: int = 0, gather_bytes: float | None = None) -> tuple[float, float]:
    """(forward, backward) seconds of TP communication for one layer and micro-batch. `regather`:
    how many times, under sequence parallelism, the backward all-gathers again each input its
    column-parallel linears kept as a shard (training.sp_saved_inputs "shard", runtime.sp_shard;
    regathers), two inputs a block, one in the head. `gather_bytes`: what a block's all-gathers
    move where not act_bytes (FP8 linears gather 8-bit tensors: planner.fp8.gathered_act_bytes)."""
    if len(tp_ranks) <= 1:
        return 0.0, 0.0
    ar = cluster.collective_time("all_reduce", act_bytes, tp_ranks)
    ag = cluster.collective_time("all_gather", act_bytes if gather_bytes is None else gather_bytes, tp_ranks)
    rs = cluster.collective_time("reduce_scatter", act_bytes, tp_ranks)
    again = ag * regather if sp else 0.0
    if kind == "embedding":  # vocab-parallel lookup: partial sums combined
        return (rs, ag) if sp else (ar, 0.0)
    if kind == "head":  # column-parallel head: gather input (SP), combine input grads; the loss's reductions
        # runtime/loss.py, per row chunk: the float32 row maxima, then two float32 sums per row
        rows = math.ceil(b * s / LOSS_CHUNKS)
        loss = LOSS_CHUNKS * (cluster.collective_time("all_reduce", 4.0 * rows, tp_ranks)
                              + cluster.collective_time("all_reduce", 8.0 * rows, tp_ranks))
        return ((ag + loss, rs + again) if sp else (loss, ar))
    if sp:
        return 2 * (ag + rs), 2 * (ag + rs + again)
    return 2 * ar, 2 * ar


def overlapped_sp_comm(cluster: ClusterSpec, act_bytes: float, gather_bytes: float, tp_ranks: list, linear_s: list,
                       regather: int = 0) -> tuple[float, float]:
    """(forward, backward) exposed seconds of a dense block's sequence-parallel collectives under
    training.tp_comm_overlap: each runs beside the GEMM of its linear layer (`linear_s`: the forward
    seconds of QKV, the output projection, the first and the second MLP projections; each backward
    GEMM takes as long), which hides ASYNC_TP_HIDDEN of the time they share, as for
    async_tp_allreduce. Forward: the all-gathers before the column-parallel linears, the
    reduce-scatters after the row-parallel ones (TransformerEngine's ub_overlap_ag and
    ub_overlap_rs); backward: the reverse collectives beside the input-gradient GEMMs, and the kept
    shards' all-gathers (`regather`) beside the column-parallel weight-gradient GEMMs (its bulk
    overlaps). tp_comm's collectives otherwise; the all-gathers move `gather_bytes`, the
    reduce-scatters `act_bytes` (planner.fp8.gathered_act_bytes)."""
    if len(tp_ranks) <= 1:
        return 0.0, 0.0
    ag = cluster.collective_time("all_gather", gather_bytes, tp_ranks)
    rs = cluster.collective_time("reduce_scatter", act_bytes, tp_ranks)
    qkv, proj, up, down = linear_s

    def hide(c, g):
        return c - ASYNC_TP_HIDDEN * min(c, g)
    fwd = hide(ag, qkv) + hide(rs, proj) + hide(ag, up) + hide(rs, down)
    bwd = hide(rs, qkv) + hide(ag, proj) + hide(rs, up) + hide(ag, down)
    return fwd, bwd + regather * (hide(ag, qkv) + hide(ag, up))


def cp_comm(cluster: ClusterSpec, kind: str, kv_bytes: float, cp_ranks, recompute: str) -> tuple[float, float]:
    """(forward, backward) seconds of context-parallel communication for one layer and
    micro-batch, all-gathered K and V (Llama 3, Dubey et al. 2024, section 3.3.2: each CP rank
    all-gathers the keys and values of the whole sequence and attends its own queries to them,
    the all-gather exposed on the critical path): a block's forward all-gathers `kv_bytes` (K and V
    of the whole sequence, this rank's heads), its backward reduce-scatters their gradients, after
    gathering them again where the attention is recomputed (selective or full)."""
    if kind != "block" or len(cp_ranks) <= 1:
        return 0.0, 0.0
    ag = cluster.collective_time("all_gather", kv_bytes, cp_ranks)
    return ag, cluster.collective_time("reduce_scatter", kv_bytes, cp_ranks) + (ag if recompute != "none" else 0.0)


def regathers(training, recompute: str, split: bool = False) -> int:
    """How many times a layer's backward all-gathers its kept shards again (tp_comm's `regather`):
    once, the runtime's default (training.sp_saved_inputs "shard"), unless the layer is fully
    recomputed (the replayed forward gathers and keeps what the weight gradients read); twice
    under a split backward (`split`: zbv's I and W, planner.plan.split_backward), whose I unpacks
    every tensor its nodes saved, the kept input too, and whose W reads it again after I dropped
    it (runtime.sp_shard keeps no whole input between them). Megatron-LM issues that all-gather
    before the input-gradient GEMM and overlaps the two (megatron/core/tensor_parallel/layers.py),
    which training.async_tp_allreduce stands for here: not priced then."""
    if training.sp_saved_inputs != "shard" or recompute == "full" or training.async_tp_allreduce:
        return 0
    return 2 if split else 1


def gather_beside_forward(training, cluster: ClusterSpec) -> bool:
    """Whether ZeRO 1/2's gather of the updated parameters runs beside the next forward
    (training.overlap_param_gather) on this cluster: where a device computes apart from the host
    that issues the gathers (a GPU's streams). CPU processes (gloo) compute on the host, which waits
    for each block's gather as FSDP2's hook issues it (measured: small-w2-zero1 in
    benchmarks/prediction_accuracy.py, 783.9 ms a step, priced 718.9 with the gather after the
    step and 661.4 beside the forward)."""
    return training.overlap_param_gather and cluster.backend != "gloo"


def overlap_steal(cluster: ClusterSpec) -> float:
    """The share of a device's compute rate that a collective takes while it runs beside the
    compute: 1 - 1 / cluster.overlap_slowdown (compute time with communication beside it over the
    time alone; the profiles' source). A collective kernel occupies SMs and memory bandwidth the
    compute would use: Lee et al. 2025 (arXiv 2507.03114) measured compute overlapped with
    communication 18.9% slower on average (40% at most) over GPT and Llama training on A100, H100,
    MI250 and MI210, the figure the shipped GPU profiles carry."""
    return 1.0 - 1.0 / cluster.overlap_slowdown


def exposed_beside(comm_s, compute_s, steal: float):
    """Seconds that `comm_s` of communication running beside `compute_s` of compute adds to it,
    where the compute runs at 1 - `steal` of its rate while the communication runs: the
    communication's excess over the compute, or the compute it slows, whichever is more (both run
    to their ends: max(comm, compute + steal x comm) - compute). Numbers, or numpy arrays element
    by element (planner.menus prices its options so)."""
    if isinstance(comm_s, np.ndarray) or isinstance(compute_s, np.ndarray):
        return np.maximum(comm_s - compute_s, steal * comm_s)  # steal x comm >= 0: overlap_slowdown >= 1
    return max(0.0, comm_s - compute_s, steal * comm_s)


def reduce_beside_backward(training, cluster: ClusterSpec) -> bool:
    """Whether a stage's data-parallel gradient reduction runs beside its own last backward, block
    by block as each block's gradients are complete (training.overlap_grad_reduce on a GPU
    cluster): FSDP2 reduce-scatters each block's gradients in its post-backward hook, Megatron-LM's
    DDP each bucket of max(40M, 1M x dp) parameters once its gradients are all in (megatron/core/
    distributed/ at core_r0.8.0: distributed_data_parallel.py's bucket_size, param_and_grad_buffer.py's
    register_grad_ready), both on a stream of their own. CPU processes (gloo) compute on the host,
    and the step's reduction starts when the last of the time-sliced processes ends its backward
    (measured inside w4-dp4's step, docs/HISTORY.md session 21): there it stays after the stage's
    last backward."""
    return training.overlap_grad_reduce and cluster.backend != "gloo"


def plays_last_backward(training, cluster: ClusterSpec, zero: int, shards: int, micro_batches: int,
                        split: bool) -> bool:
    """Whether a stage's last backward plays its ZeRO 2/3 communication with its reduction's parts
    on one communicator (planner.schedule.beside_backward; priced so in planner.cost, bounded so
    in planner.menus and planner.bounds): its reduction runs beside it (reduce_beside_backward)
    over more than one shard, the backward is not split, and it has ZeRO 3's gathers or ZeRO 2/3's
    reduce-scatters of an earlier micro-batch to replace (not where training.defer_grad_sync keeps them
    to the last)."""
    return (reduce_beside_backward(training, cluster) and shards > 1 and not split and zero >= 2
            and (zero == 3 or (micro_batches > 1 and not training.defer_grad_sync)))


def clip_norm_comm(cluster: ClusterSpec, mesh, pp_rank: int, fsdp: bool, partial_bytes: float = 0.0) -> float:
    """Seconds of the all-reduces the runtime issues once per step before its optimizer step on a
    rank of pipeline rank `pp_rank`: runtime.optim.clip_grad_norm's, one scalar per sharded mesh
    dimension, tp (TP-sharded parameters) and dp (FSDP-sharded parameters, ZeRO >= 1: over the
    shard group under HSDP, whose replicas hold copies), and reduce_partial_grads' over tp of
    `partial_bytes` (sequence-parallel norms' gradients without data parallelism). The pipeline
    all-reduce is in runtime_sync."""
    groups = []
    if mesh.tp > 1:
        groups.append(mesh.group("tp", pp=pp_rank, dp=0))
    if mesh.zero_shards > 1 and fsdp:
        groups.append(mesh.shard_group(pp=pp_rank, tp=0))
    t = sum(cluster.collective_time("all_reduce", SCALAR_BYTES, g) for g in groups)
    if mesh.tp > 1 and partial_bytes > 0:
        t += cluster.collective_time("all_reduce", partial_bytes, mesh.group("tp", pp=pp_rank, dp=0))
    return t


def runtime_sync(cluster: ClusterSpec, mesh) -> float:
    """The runtime's per-step synchronization: the barrier that closes a timed step and the loss
    all-reduce over the world, plus the gradient norm's all-reduce over the pipeline ranks."""
    sync = 2 * cluster.collective_time("all_reduce", SCALAR_BYTES, list(range(mesh.world_size)))
    if mesh.pp > 1:
        sync += cluster.collective_time("all_reduce", SCALAR_BYTES, mesh.group("pp", dp=0, tp=0))
    return sync


def tied_grad_comm(cluster: ClusterSpec, plan, pp_rank: int, elem_bytes: float) -> float:
    """Seconds of the all-reduce that sums a tied embedding's gradient with its copy's in the head
    where a pipeline splits them (runtime.tied; Megatron-LM all-reduces the word embeddings'
    gradients between its first and last stages, DeepSpeed's pipeline engine its tied modules'),
    on the two pipeline ranks that hold them; 0 on the others and where one rank holds both. Each
    all-reduces its shard (vocab / tp rows, over the ZeRO shards where both stages shard
    gradients); where one stage shards and the other does not, the whole matrix."""
    m, mesh = plan.model, plan.mesh
    first, end, sharded = tied_ends(plan)
    if not m.tie_embeddings or first == end or pp_rank not in (first, end):
        return 0.0
    elems = float(m.vocab) * m.hidden
    if sharded[0] == sharded[1]:
        elems = math.ceil(m.vocab / mesh.tp) * m.hidden / (mesh.zero_shards if sharded[0] else 1)
    return cluster.collective_time("all_reduce", elems * elem_bytes, [mesh.rank(pp=first), mesh.rank(pp=end)])


def tied_ends(plan) -> tuple[int, int, tuple[bool, bool]]:
    """The pipeline ranks of the first and the last stage (a tied embedding's and its head's), and
    whether each stage shards its gradients (ZeRO 1-3 over dp x cp): where both do or neither does,
    their shards line up (runtime.tied)."""
    stages = plan.pipeline.stages
    sharded = tuple(s.zero >= 1 and plan.mesh.grad_ranks > 1 for s in (stages[0], stages[-1]))
    return plan.stage_rank(0), plan.stage_rank(len(stages) - 1), sharded


def _backward_shares(costs) -> list:
    """Per layer, last layer first as the backward runs: (layer cost, fraction of the stage's
    backward done when the layer's backward starts, and when it ends)."""
    back = [c.bwd_compute_s + c.bwd_tp_s + c.bwd_cp_s + c.bwd_ep_s for c in reversed(costs)]
    total, done, out = sum(back), 0.0, []
    for c, b in zip(reversed(costs), back):
        out.append((c, done / total if total > 0 else 0.0, (done + b) / total if total > 0 else 1.0))
        done += b
    return out


def _priced_once(layers, price) -> list:
    """`price(layer cost)` of each of `layers` (costs), layers of equal size priced once."""
    seen = {}
    for c in layers:
        key = (c.params, c.expert_params)
        if key not in seen:
            seen[key] = price(c)
    return [seen[(c.params, c.expert_params)] for c in layers]


def sync_parts(costs, reduce, replicas: float) -> tuple:
    """A stage's gradient reduction beside its last backward (planner.comm.reduce_beside_backward):
    per layer, last layer first as the backward runs, (fraction of the backward done when the
    layer's gradients are complete, seconds of `reduce(layer cost)`); HSDP's all-reduce across
    the replicas follows the last. Layers of equal size are priced once; a layer without
    parameters (a head tied to its embedding on the same stage) reduces nothing."""
    layers = [(c, end) for c, _, end in _backward_shares(costs) if c.params]
    out = [[end, x] for (_, end), x in zip(layers, _priced_once([c for c, _ in layers], reduce))]
    out[-1] = [1.0, out[-1][1] + replicas]
    return tuple(map(tuple, out))


def backward_gathers(costs, kinds, gather) -> tuple:
    """ZeRO 3's parameter all-gathers in a stage's last backward (planner.schedule.beside_backward's
    `gathers`): per layer, last layer first as the backward runs, (fraction of the backward done
    when the layer's backward starts, seconds of `gather(layer cost)`), with sync_parts' fractions.
    None for a head (runtime.parallelize keeps it gathered from its forward to its backward) or a
    layer without parameters of its own. Layers of equal size are priced once."""
    layers = [(c, start) for (c, start, _), kind in zip(_backward_shares(costs), reversed(kinds))
              if c.params and kind != "head"]
    return tuple((start, x) for (_, start), x in zip(layers, _priced_once([c for c, _ in layers], gather)))
