"""Time and memory of a plan on a cluster: the cost model behind `trident estimate`.

Time of a layer on one device, per micro-batch:
- matrix multiplications: the roofline of each GEMM, the slower of FLOPs / (peak x achieved matmul
  efficiency of the profile) and bytes / achieved memory bandwidth. Fused
  causal attention skips the blocks above the diagonal, so it does half the score/context FLOPs
  (Dao et al., FlashAttention, 2022) and its backward runs 5 matmuls to the forward's 2 (Dao,
  FlashAttention-2, 2023, section 3.1.2); unfused attention computes the full square.
- memory-bound operations (norms, activation functions, softmax, dropout, residual adds, RoPE,
  cross-entropy; planner.pointwise), adding up micro-batch gradients, the runtime's autocast casts
  of its weights (planner.precision): bytes moved / achieved memory bandwidth.
- TP communication, issued by the runtime and not overlapped (Megatron-style): per block two
  all-reduces of the activation in forward and two in backward, or with sequence parallelism an
  all-gather and a reduce-scatter in place of each (Korthikanti et al. 2022, section 4.2.2).
  With training.async_tp_allreduce (Megatron-LM, prediction only) each backward all-reduce of a
  column-parallel input gradient runs beside its weight-gradient GEMM, which hides part of it
  (ASYNC_TP_HIDDEN).
- recomputation: full replays the block's forward (its compute and its TP communication) before
  the backward; selective replays only the attention core.
Per stage the per-layer times add up; the pipeline schedule is then played (planner.schedule).
Data-parallel gradient communication runs on a communication stream, layer by layer beside
each stage's last backward as its gradients are complete (planner.comm.reduce_beside_backward; on
CPU processes after that backward), overlapping the rest of the backward (with
training.overlap_grad_reduce false: after the whole backward); ZeRO-2 and 3 reduce-scatter every
micro-batch's gradients on that stream, which slows a backward only where it takes longer (the
last one's are played with its reduction's parts); ZeRO-3
gathers parameters before each forward and backward, overlapped with compute by prefetching; a
collective beside compute slows that compute (planner.comm.exposed_beside, planner.schedule); the
optimizer step (AdamW with gradient clipping) is memory-bound, and every pipeline rank's waits for
the gradient norm over all of them
(and, for a tied embedding split from its head, the first and last stages' ranks for the all-reduce
of its gradient with the copy's: planner.comm.tied_grad_comm).
Under HSDP (mesh.dp_replicate > 1) all of that runs over the shard group (dp / dp_replicate
ranks), and each stage's reduced shard is then all-reduced across the replicas once a step, after
its last reduce-scatter.

Memory per device follows what the runtime holds: parameters, gradients and optimizer states by
ZeRO level (Rajbhandari et al., ZeRO, 2020: 2 + 2 + 12 bytes per parameter in mixed precision
with Adam; gradients in the dtype they add up in, float32 in the runtime's and Megatron-LM's bf16
runs; planner.precision), activations of the micro-batches in flight (planner.orders.peak_in_
flight) by recompute mode (planner.model; planner.precision: autocast's, the CPU runtime's norms),
the replay of one block, activation gradients, communication and receive buffers, FSDP2's (planner.memory)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from planner.cluster import ClusterSpec
from planner.comm import (backward_gathers, clip_norm_comm, exposed_beside, gather_beside_forward, overlap_steal,
                          plays_last_backward, reduce_beside_backward, runtime_sync, sync_parts, tied_grad_comm)
from planner.fp8 import gathered_bytes_per_param
from planner.fsdp_memory import grads_sharded
from planner.layers import layer_cost, partial_grad_params, replicated_params, tied_head
from planner.memory import memory_by_rank
from planner.model import ConfigError
from planner.plan import DTYPES, Plan, split_backward
from planner.precision import fsdp_copy_bytes, grad_bytes, model_state_bytes, optimizer_step_bytes
from planner.schedule import Sharing, StageTimes, simulate

# a step priced longer than this (3 trillion years) comes from a rate too small to be a figure
MAX_PRICED_STEP_S = 1e20


@dataclass
class Estimate:
    step_time_s: float
    tokens_per_s: float
    model_tflops_per_gpu: float
    mfu: float
    peak_memory_bytes: float
    memory_limit_bytes: float
    required_bytes: float
    fits: bool
    parameters: int
    breakdown: dict
    hardware_tflops_per_gpu: float = 0.0  # recomputation included
    hfu: float = 0.0
    stages: list = field(default_factory=list)
    timeline: object = None
    active_parameters: int = 0  # those a token's FLOPs count: an MoE model's k experts a block (the rest: all)

    def to_dict(self) -> dict:
        return {
            "parameters": self.parameters, "active_parameters": self.active_parameters,
            "step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s,
            "model_tflops_per_gpu": self.model_tflops_per_gpu,
            "mfu": self.mfu,
            "hardware_tflops_per_gpu": self.hardware_tflops_per_gpu,
            "hfu": self.hfu,
            "peak_memory_bytes": self.peak_memory_bytes,
            "required_memory_bytes": self.required_bytes,
            "memory_limit_bytes": self.memory_limit_bytes,
            "fits": self.fits,
            "breakdown": self.breakdown,
            "stages": self.stages,
        }


# ------------------------------------------------------------------ the estimate

def _residue(total: float, part: float) -> float:
    """total - part, 0 where it is float rounding (1e-15 s of bubble on a one-stage plan)."""
    d = total - part
    return d if d > 1e-9 * abs(total) else 0.0


def _stage_layer_costs(plan: Plan, cluster: ClusterSpec, st, tp_ranks: list, model_profile, extras: bool) -> list:
    """layer_cost of each of a stage's layers, priced once for each (kind, recompute mode): a layer's
    cost depends on its index only through those (a stage's blocks alike)."""
    m, priced, costs = plan.model, {}, []
    for i in range(st.start, st.end):
        key = (m.layer_kind(i), st.recompute[i - st.start])
        if key not in priced:
            priced[key] = layer_cost(plan, cluster, i, st, tp_ranks, model_profile, extras)
        costs.append(priced[key])
    return costs


def estimate(plan: Plan, cluster: ClusterSpec, memory_limit_bytes: float | None = None,
             keep_timeline: bool = False, model_profile=None, profile_extras: bool = True) -> Estimate:
    """Predict step time, throughput and per-device memory of `plan` on `cluster`.

    With `model_profile` (planner.model_profile.ModelProfile, measured on this cluster) the layer
    times and bytes come from its measurements instead of FLOPs and bytes moved (see
    planner.model_profile.profiled_layer_cost), data-parallel extras from its measurement of the
    runtime's replicate / FSDP wrapping where it has one, each pipeline operation adds its measured
    overhead, the optimizer from its measured per-layer step, and the step adds the
    runtime's own per-step synchronization (runtime_sync_s: the barrier that closes a timed step
    and the loss all-reduce over the world, plus the gradient-norm all-reduce over pp ranks),
    priced by the cluster profile. Without `profile_extras` only the layers come from the model
    profile (their times and bytes, without their data-parallel extras) and the rest is priced as
    without one: what the search partitions with (planner.search.search_profiled)."""
    if model_profile is not None:
        model_profile.check_plan(plan)
    extras = model_profile is not None and profile_extras
    m, t, mesh, pipe = plan.model, plan.training, plan.mesh, plan.pipeline
    cluster = cluster.shaped_as(plan.cluster.nodes, plan.cluster.devices_per_node)
    # `dp`: the ranks that hold a stage's parameters and add up its gradients (dp x cp); `shard`: those
    # ZeRO shards over (dp, or HSDP's shard group, x cp)
    dp, tp, pp, v, mbs = mesh.grad_ranks, mesh.tp, mesh.pp, pipe.virtual_stages, pipe.micro_batches
    shard = mesh.zero_shards
    e = DTYPES[t.dtype]
    gb = model_state_bytes(t)[1]
    bw = cluster.device.memory_bytes_per_s
    steal = overlap_steal(cluster)  # of the compute rate, while a collective runs beside it
    stage_times, stage_info = [], []
    pipe_op = model_profile.pipeline_overhead(pipe.schedule) if (extras and pp > 1) else 0.0
    for si, st in enumerate(pipe.stages):
        r = plan.stage_rank(si)
        tp_ranks = mesh.group("tp", pp=r, dp=0)
        dp_ranks, rep_ranks = mesh.shard_group(pp=r, tp=0), mesh.replicate_group(pp=r, tp=0)
        ex_ranks = mesh.expert_shard_group(pp=r, tp=0)
        costs = _stage_layer_costs(plan, cluster, st, tp_ranks, model_profile, extras)
        if m.tie_embeddings and st.end == m.num_layers_total and st.start == 0:  # one matrix: runtime.tied
            costs[-1] = tied_head(m, costs[-1], tp)
        comp_f = sum(c.fwd_compute_s for c in costs)
        comp_b = sum(c.bwd_compute_s for c in costs)
        tpc_f = sum(c.fwd_tp_s for c in costs)
        tpc_b = sum(c.bwd_tp_s for c in costs)
        cpc_f, cpc_b = sum(c.fwd_cp_s for c in costs), sum(c.bwd_cp_s for c in costs)
        epc_f, epc_b = sum(c.fwd_ep_s for c in costs), sum(c.bwd_ep_s for c in costs)
        params, ex = sum(c.params for c in costs), sum(c.expert_params for c in costs)
        fp8_params = (sum(c.params - replicated_params(m, "block") for i, c in zip(range(st.start, st.end), costs)
                          if m.layer_kind(i) == "block") if t.fp8_param_gather else 0.0)
        pe = gathered_bytes_per_param(t, e, params, fp8_params)  # gathered bytes a parameter

        def dp_collective(op: str, per_param: float, p: float = params, x: float = ex) -> float:
            """`op` on the bytes of p parameters (per_param each; the stage's by default) over the
            shard group, the x of them experts spread by expert parallelism over their own
            (planner.moe)."""
            dense = cluster.collective_time(op, (p - x) * per_param, dp_ranks)
            return dense + (cluster.collective_time(op, x * per_param, ex_ranks) if x else 0.0)
        grad_total = params * gb
        # ZeRO 2/3 reduce-scatter each micro-batch's gradients, unless deferred to the last (ZeRO 1's)
        reduces_each = mbs > 1 and grads_sharded(st.zero, mbs, t.defer_grad_sync)
        zero3_f = zero3_b = zero3_w = 0.0
        split = split_backward(pipe.schedule, pp)  # its backward is two operations, I and W
        measured_dp = dp > 1 and all(c.dp_measured for c in costs)
        # HSDP: the reduced shard all-reduced across the replicas once a step (the runtime skips it
        # on the other micro-batches: FSDP2's set_requires_all_reduce), after the last reduce-scatter
        replicas = (cluster.collective_time("all_reduce", (grad_total + ex * gb * (mesh.ep - 1)) / shard, rep_ranks)
                    if mesh.dp_replicate > 1 else 0.0)
        ag = dp_collective("all_gather", pe) if (shard > 1 and st.zero == 3) else 0.0
        # the backward's: a head stays gathered from its forward to its backward (runtime.parallelize)
        head = costs[-1].params if m.layer_kind(st.end - 1) == "head" else 0.0
        ag_b = dp_collective("all_gather", pe, params - head) if ag else 0.0
        if ag:  # gather parameters before forward and again before backward
            zero3_f = exposed_beside(ag, comp_f, steal)
            zero3_b = exposed_beside(ag_b, comp_b, steal)
        # FSDP2's copies out of its gather buffers and into its reduce buffers, on the compute stream
        # (measured with the data-parallel wrapping where the model profile has it)
        copy_f = copy_b = copy_step = 0.0
        if t.fsdp_copies and not measured_dp:
            copy_f, copy_b, copy_step = (x * params / bw for x in fsdp_copy_bytes(st.zero, shard, mbs, e, gb,
                                                                                  t.defer_grad_sync))
        if measured_dp:  # the model profile measured the runtime's data-parallel wrapping itself
            zero3_f = sum(c.dp_measured["forward_s"] for c in costs)
            zero3_b = sum(c.dp_measured["backward_s"] for c in costs)
            # FSDP (ZeRO >= 1) shards block by block, as measured layer by layer; replicate (ZeRO 0)
            # all-reduces the whole chunk's gradients at once: one collective, priced by the cluster
            sync = (cluster.collective_time("all_reduce", grad_total, dp_ranks) if st.zero == 0 else
                    sum(c.dp_measured["backward_sync_s"] for c in costs))
            if reduces_each:  # every backward is a synchronizing one, as measured
                zero3_b, sync = zero3_b + sync, 0.0
            sync += replicas
        elif dp <= 1:
            sync = 0.0
        elif st.zero == 0:
            sync = dp_collective("all_reduce", gb)
        else:
            rs = dp_collective("reduce_scatter", gb)
            sync = rs + replicas
            if reduces_each:  # each micro-batch's, beside its backward (and its gathers)
                zero3_b = exposed_beside(ag_b + rs, comp_b, steal)
        parts = ()
        if sync and not measured_dp and reduce_beside_backward(t, cluster):
            parts = sync_parts(costs, lambda c: dp_collective("all_reduce" if st.zero == 0 else "reduce_scatter",
                                                              gb, c.params, c.expert_params), replicas)
        # ZeRO 3's backward gathers on the reduction's communicator, played with its parts in the
        # stage's last backward (planner.schedule.beside_backward) instead of priced beside it
        # (zero3_b: exposed_beside; under ZeRO 2 and 3 the earlier micro-batches' backwards are each
        # priced with their own reduce-scatters so, and the last one's are its parts)
        gathers, played = (), bool(parts) and plays_last_backward(t, cluster, st.zero, dp, mbs, split)
        if played and ag:
            gathers = backward_gathers(costs, [m.layer_kind(i) for i in range(st.start, st.end)],
                                       lambda c: dp_collective("all_gather", pe, c.params, c.expert_params))
        if split and st.zero >= 2 and dp > 1:
            # runtime.pipeline: I and W each gather the chunk's blocks before computing (ZeRO 3), and
            # W reduce-scatters the micro-batch's gradients after its own computation (measured: I's)
            zero3_w = ag if measured_dp else ag + exposed_beside(rs, sum(c.bwd_weight_s for c in costs), steal)
            zero3_b = zero3_b if measured_dp else ag
        # point-to-point: this stage's output to the next stage (sharded under sequence parallelism);
        # scatter-gather sends 1/tp from each TP rank and the receiving TP group all-gathers it
        act_msg = e * plan.rank_micro_batch * t.seq_len * m.hidden / (tp if st.sequence_parallel else 1)
        scatter = pipe.p2p == "scatter-gather" and tp > 1 and not st.sequence_parallel

        def transfer(peer: int) -> float:
            src, dst = mesh.rank(pp=r, dp=0, tp=0), mesh.rank(pp=peer, dp=0, tp=0)
            if not scatter:
                return cluster.p2p_time(act_msg, src, dst)
            return cluster.p2p_time(act_msg / tp, src, dst) + cluster.collective_time("all_gather", act_msg, tp_ranks)
        # to the next and previous stages' ranks (under zbv the middle two share a rank: no transfer)
        nxt, prev = si + 1 < len(pipe.stages), si > 0
        send = transfer(plan.stage_rank(si + 1)) if nxt and plan.stage_rank(si + 1) != r else 0.0
        send_back = transfer(plan.stage_rank(si - 1)) if prev and plan.stage_rank(si - 1) != r else 0.0
        stage_times.append(StageTimes(fwd_s=comp_f + tpc_f + cpc_f + epc_f + zero3_f + copy_f + pipe_op,
                                      bwd_s=comp_b + tpc_b + cpc_b + epc_b + zero3_b + zero3_w + copy_b
                                      + pipe_op * (2 if split else 1),
                                      send_fwd_s=send, send_bwd_s=send_back, grad_sync_s=sync, grad_sync_parts=parts,
                                      bwd_gathers=gathers, bwd_gather_s=zero3_b if played else 0.0,
                                      bwd_weight_s=sum(c.bwd_weight_s for c in costs) + zero3_w
                                      + (pipe_op if split else 0.0)))
        stage_info.append(dict(index=si, pp_rank=r, layers=list(st.layers), zero=st.zero,
                               fwd_compute_s=comp_f, bwd_compute_s=comp_b, fwd_tp_s=tpc_f, bwd_tp_s=tpc_b,
                               **({"fwd_cp_s": cpc_f, "bwd_cp_s": cpc_b} if mesh.cp > 1 else {}),
                               **({"fwd_ep_s": epc_f, "bwd_ep_s": epc_b, "expert_params": ex} if mesh.ep > 1 else {}),
                               zero3_gather_exposed_s=(zero3_f + zero3_b + zero3_w) * mbs, grad_sync_s=sync,
                               fsdp_copy_s=(copy_f + copy_b) * mbs, fsdp_copy_step_s=copy_step,
                               params=params, gathered_bytes=pe, optimizer_s=sum(c.optimizer_s for c in costs),
                               measured_dp=measured_dp, costs=costs))
    timed_busy = model_profile.processes if model_profile is not None else 1  # processes computing when timed
    how = dict(overlap_grad_reduce=t.overlap_grad_reduce, lockstep=pipe.lockstep,
               sharing=Sharing.of(cluster.compute_slots, mesh.world_size, tp * dp, timed_busy),
               steal=steal)
    tl = simulate(pipe.schedule, pp, v, mbs, stage_times, p2p=True, **how)
    tl0 = simulate(pipe.schedule, pp, v, mbs, stage_times, p2p=False, **how) if pp > 1 else tl

    # optimizer step and, for ZeRO 1/2, the parameter all-gather after it; then the slowest rank
    at_norm, per_rank = [], []  # each rank's arrival at the gradient norm's pipeline all-reduce
    for r in range(pp):
        mine = [stage_info[i] for i in plan.stages_of_rank(r)]
        # the experts spread by expert parallelism shard over shard / ep ranks (planner.moe)
        opt_params = sum((si["params"] + si.get("expert_params", 0.0) * (mesh.ep - 1))
                         / (shard if si["zero"] >= 1 else 1) for si in mine)
        opt_s = opt_params * optimizer_step_bytes(t) / bw
        if extras:  # measured at dp=1: per-tensor overheads dominate small layers
            opt_s = sum(si["optimizer_s"] for si in mine)
        norm_comm = (clip_norm_comm(cluster, mesh, r, any(si["zero"] >= 1 for si in mine),
                                    partial_grad_params(plan, r) * grad_bytes(t))
                     + tied_grad_comm(cluster, plan, r, grad_bytes(t)))
        gather = 0.0
        if dp > 1:
            dp_ranks, ex_ranks = mesh.shard_group(pp=r, tp=0), mesh.expert_shard_group(pp=r, tp=0)
            for si in mine:
                if si["zero"] in (1, 2):  # once a step: the runtime keeps them gathered until then
                    ex = si.get("expert_params", 0.0)
                    pe = si["gathered_bytes"]
                    ag = cluster.collective_time("all_gather", (si["params"] - ex) * pe, dp_ranks)
                    ag += cluster.collective_time("all_gather", ex * pe, ex_ranks) if ex else 0.0
                    # in the next step's first forward, as ZeRO 3's forward gathers beside its compute
                    gather += (exposed_beside(ag, si["fwd_compute_s"], steal) if gather_beside_forward(t, cluster)
                               else ag)
        copies = sum(si["fsdp_copy_step_s"] for si in mine)
        at_norm.append(tl.end_s[r] + norm_comm)
        per_rank.append((opt_s, gather, copies, norm_comm))
    # the gradient norm is summed over the pipeline ranks before any of them steps
    # (runtime.optim.clip_grad_norm; Megatron-LM's clip_grad_norm_fp32 over its model-parallel
    # group, TP x PP): each rank's optimizer step waits for the last rank's backward, and the step
    # for the slowest optimizer step
    sync = runtime_sync(cluster, mesh) if extras else 0.0
    after = [opt_s + gather + copies for opt_s, gather, copies, _ in per_rank]
    slow = max(range(pp), key=lambda i: (after[i], -i))
    last = max(at_norm)
    step = last + after[slow] + sync
    waits = [last - x for x in at_norm]  # each rank's, for the last one
    terms = [x for st in stage_times for x in vars(st).values() if isinstance(x, float)]
    if not all(math.isfinite(x) for x in at_norm + terms) or step > MAX_PRICED_STEP_S:
        raise ConfigError(f"{cluster.name}: the profile prices this plan's step at {step:g} s: one of its rates "
                          "or bandwidths (device.peak_flops, matmul_efficiency, matmul_flops_by_size, "
                          "attention_flops_by_seq, memory_bandwidth_bytes_per_s, a tier's or a collective's "
                          "bandwidth) is too small to compute with; check the profile")
    r = max(range(pp), key=lambda i: (at_norm[i], -i))  # the last to reach the norm's all-reduce
    mine = [stage_info[i] for i in plan.stages_of_rank(r)]
    compute = sum((si["fwd_compute_s"] + si["bwd_compute_s"]) * mbs for si in mine)
    tp_time = sum((si["fwd_tp_s"] + si["bwd_tp_s"]) * mbs for si in mine)
    cp_time = sum((si.get("fwd_cp_s", 0.0) + si.get("bwd_cp_s", 0.0)) * mbs for si in mine)
    ep_time = sum((si.get("fwd_ep_s", 0.0) + si.get("bwd_ep_s", 0.0)) * mbs for si in mine)
    zero3 = sum(si["zero3_gather_exposed_s"] for si in mine)
    pipe_overhead = (3 if split_backward(pipe.schedule, pp) else 2) * pipe_op * mbs * len(mine)  # F, B or F, I, W
    copies = sum(si["fsdp_copy_s"] for si in mine)
    busy = compute + tp_time + cp_time + ep_time + zero3 + copies + pipe_overhead
    if how["sharing"] is not None and busy > 0:  # operations ran at the shared speed: scale to the played time
        f = tl0.busy_s[r] / busy
        compute, tp_time, cp_time, ep_time, zero3, copies, pipe_overhead, busy = (
            x * f for x in (compute, tp_time, cp_time, ep_time, zero3, copies, pipe_overhead, busy))
    slowed = tl0.slowed_s[r]  # the reduction beside the rank's last backwards slowed them (planner.schedule)
    bubble = _residue(tl0.compute_end_s[r] - slowed, busy)
    p2p = _residue(tl.compute_end_s[r], tl0.compute_end_s[r])
    # then the slowest rank's optimizer step and what follows it
    dp_exposed = (tl.end_s[r] - tl.compute_end_s[r]) + slowed + zero3 + per_rank[slow][1]
    optimizer = per_rank[slow][0] + per_rank[r][3]  # with the collectives before the step
    time_breakdown = {"compute_s": compute, "tp_comm_s": tp_time, **({"cp_comm_s": cp_time} if mesh.cp > 1 else {}),
                      **({"ep_comm_s": ep_time} if mesh.ep > 1 else {}),
                      "dp_comm_exposed_s": dp_exposed,
                      "fsdp_copy_s": copies + per_rank[slow][2],
                      "pipeline_bubble_s": bubble, "p2p_s": p2p, "optimizer_s": optimizer,
                      "critical_pp_rank": r}
    if how["sharing"] is not None:  # the ranks' processes share this many compute units (CPU cores)
        time_breakdown["compute_slots"] = how["sharing"].slots
    if extras:
        time_breakdown["runtime_sync_s"] = sync
        time_breakdown["pipeline_overhead_s"] = pipe_overhead

    mem_by_rank = memory_by_rank(plan, stage_info, rs_temp=cluster.backend == "gloo")
    peak_rank = max(mem_by_rank, key=lambda d: d["total_bytes"])
    peak = peak_rank["total_bytes"]
    dev = cluster.device
    limit = memory_limit_bytes if memory_limit_bytes is not None else dev.memory_bytes
    required = peak * (1 + dev.allocator_overhead_fraction) + dev.reserved_bytes
    memory_breakdown = {k: peak_rank[k] for k in ("parameters_bytes", "gradients_bytes", "optimizer_bytes",
                                                  "activations_bytes", "other_bytes", "other_parts")}
    memory_breakdown["pp_rank"] = peak_rank["pp_rank"]
    memory_breakdown["peak_at"] = peak_rank["peak_at"]  # backward | end of backward | optimizer step

    world = mesh.world_size
    tokens = t.global_batch * t.seq_len
    # MFU counts the model's FLOPs, not the recomputed ones (Chowdhery et al. 2022, PaLM, appendix B;
    # Korthikanti et al. 2022, section 6.1), so that it ranks plans as their step times do; HFU
    # counts what the step executes, as Megatron-LM's published TFLOP/s with full recomputation
    blocks = [plan.recompute_of_layer(i) for i in range(1, m.layers + 1)]
    tflops = m.model_flops_per_step(t.global_batch, t.seq_len) / step / world / 1e12
    executed = m.executed_flops_per_step(t.global_batch, t.seq_len, blocks, t.selective_recompute)
    hw_tflops = executed / step / world / 1e12
    stages_out = [{**{k: v for k, v in si.items() if k != "costs"},
                   "memory": next(x for x in mem_by_rank if x["pp_rank"] == si["pp_rank"])["total_bytes"]}
                  for si in stage_info]
    priced_by = {"cluster_profile": {"name": cluster.name, "hash": cluster.profile_hash}}
    if model_profile is not None:
        priced_by["model_profile"] = {"name": model_profile.name, "hash": model_profile.profile_hash}
    return Estimate(
        step_time_s=step, tokens_per_s=tokens / step, model_tflops_per_gpu=tflops,
        mfu=tflops * 1e12 / dev.peak_flops[t.dtype], hardware_tflops_per_gpu=hw_tflops,
        hfu=hw_tflops * 1e12 / dev.peak_flops[t.dtype], peak_memory_bytes=peak, memory_limit_bytes=limit,
        required_bytes=required, fits=required <= limit, parameters=m.num_parameters(),
        active_parameters=m.active_parameters(),
        breakdown={"time": time_breakdown, "memory": memory_breakdown,
                   "memory_per_pp_rank": [x["total_bytes"] for x in mem_by_rank],
                   # the step itself, as the run times it (the slowest rank's, its collectives left out)
                   "optimizer_per_pp_rank_s": [x[0] for x in per_rank],
                   # each rank's wait, before its optimizer step, for the last rank's backward
                   "optimizer_wait_per_pp_rank_s": waits,
                   "bubble_fraction": bubble / step if step else 0.0, "priced_by": priced_by},
        stages=stages_out, timeline=tl if keep_timeline else None)
