"""Bytes per parameter under a plan's precision: what model states take in memory, what the
gradients are held and reduced in, and what the optimizer step moves (planner.cost and the search
price plans with them).

Mixed precision keeps 16-bit working parameters, float32 master weights and float32 Adam moments
(Micikevicius et al. 2018; Rajbhandari et al., ZeRO, 2020: 2 + 2 + 12 bytes per parameter); the
runtime (FSDP2 MixedPrecisionPolicy) and Megatron-LM's bf16 runs hold their gradients in float32.
"""
from __future__ import annotations

from planner.fsdp_memory import grads_sharded
from planner.plan import DTYPES

ADAM_STATE_BYTES = 8  # two float32 moments per parameter
ADAM_MOMENTS = ("fp32", "param_dtype")  # training.adam_moments (adam_state_bytes)
MASTER_BYTES = 4  # float32 master copy under mixed precision
# bytes per parameter and micro-batch of adding a micro-batch's gradient to the accumulated one
# (training.grad_accumulation): read both, write the sum; fused into the weight-gradient GEMM, none
GRAD_ACCUMULATION_BYTES = {"separate-fp32": 3 * 4, "separate-16bit": 3 * 2, "fused": 0, "fused-16bit": 0}


def model_state_bytes(t, dp: int = 2) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer) bytes per parameter. Gradients are held in the dtype they
    are accumulated and reduced in (grad_bytes). The runtime without data parallelism under mixed
    precision (casts_weights) keeps no 16-bit copy: its float32 weights are the master copy,
    counted as the parameters; the 16-bit casts it holds per micro-batch are activations
    (autocast_held_bytes)."""
    if casts_weights(t, dp):
        return 4, grad_bytes(t), ADAM_STATE_BYTES
    e = DTYPES[t.dtype]
    master = MASTER_BYTES if (t.master_weights and t.dtype != "fp32") else 0
    return e, grad_bytes(t), adam_state_bytes(t) + master


def updated_bytes(t) -> int:
    """Bytes per parameter of what AdamW updates: the float32 master copy under mixed precision,
    else the parameters in their own dtype."""
    e = DTYPES[t.dtype]
    return 4 if (t.master_weights and e == 2) else e


def adam_state_bytes(t) -> int:
    """Bytes per parameter of AdamW's two moments: float32 (training.adam_moments "fp32"), or
    "param_dtype", torch's AdamW's own choice (its state is zeros_like the parameter): the dtype of
    what AdamW updates (updated_bytes), float32 where there is a master copy, the 16-bit weights
    themselves where there is none (KempnerForge's bf16 runs, benchmarks/run_settings.py)."""
    return ADAM_STATE_BYTES if t.adam_moments == "fp32" else 2 * updated_bytes(t)


def sharded_param_bytes(t) -> int:
    """Bytes per parameter of the shard of parameters FSDP2 keeps (ZeRO 3; beside the unsharded
    parameters under ZeRO 1/2) beyond the optimizer state: none under mixed precision, where
    FSDP2 keeps float32 parameters and gathers 16-bit ones (MixedPrecisionPolicy), so its shard is
    the master copy; the parameter dtype otherwise."""
    e = DTYPES[t.dtype]
    return 0 if (t.master_weights and e == 2) else e


def grad_bytes(t) -> int:
    """Bytes per gradient element as gradients are accumulated, held and reduced across data
    parallelism. Mixed precision keeps them in float32: the runtime's FSDP2 reduces in float32
    (MixedPrecisionPolicy reduce_dtype) and, between micro-batches, accumulates its unsharded
    gradients in that dtype; Megatron-LM's bf16 runs keep float32 main_grad buffers. They stay in
    16 bits where they add up in 16 bits (training.grad_accumulation separate-16bit or fused-16bit: Megatron-LM
    fp16, DeepSpeed fp16) and in pure 16-bit training (no master weights)."""
    e = DTYPES[t.dtype]
    if t.grad_accumulation in ("separate-16bit", "fused-16bit") or not t.master_weights:
        return e
    return max(e, 4)


def deferred_grad_bytes(t) -> int:
    """Bytes per gradient element that FSDP2 accumulates unsharded where its sync is deferred
    (training.defer_grad_sync): its reduce dtype, float32 (torch/distributed/fsdp/_fully_shard/
    _fsdp_param.py, to_accumulated_grad_if_needed: the unsharded gradient is cast to the reduce dtype
    to accumulate), unless gradients add up in 16 bits (training.grad_accumulation separate-16bit,
    fused-16bit: a 16-bit reduce dtype). Pure 16-bit training (no master weights) reducing in
    float32, KempnerForge's (its MixedPrecisionPolicy), holds 4 bytes there where grad_bytes counts 2."""
    e = DTYPES[t.dtype]
    return e if t.grad_accumulation in ("separate-16bit", "fused-16bit") else max(e, 4)


def fsdp_copy_bytes(zero: int, dp: int, micro_batches: int, e: int, gb: int,
                    defer: bool = False) -> tuple[int, int, int]:
    """(per forward, per backward, per step) bytes per parameter that the runtime's data
    parallelism copies on the compute stream around its collectives (torch 2.13,
    torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py): foreach_all_gather_copy_out reads
    each gathered parameter out of the all-gather buffer into its unsharded tensor (e read, e
    written) on the current stream once the gather lands; foreach_reduce_scatter_copy_in
    concatenates the unsharded gradients into the reduce-scatter (or replicate's all-reduce)
    buffer in the reduce dtype (e read, gb written), also on the current stream. ZeRO-3 gathers
    before every forward and backward and reduce-scatters every backward; ZeRO-2 reduce-scatters
    every backward and gathers once a step; ZeRO-1 and 0 reduce once a step, ZeRO-1 gathering once.
    Frameworks that gather into and reduce from flat buffers (Megatron-LM's DDP, PyTorch's FSDP1)
    copy nothing (training.fsdp_copies false). Nothing without data parallelism. Deferring the
    sync to the last of several micro-batches (`defer`, training.defer_grad_sync) copies in once a
    step: ZeRO 3 still gathers for each forward and backward, ZeRO 2 is then ZeRO 1."""
    if dp <= 1:
        return 0, 0, 0
    gather, reduce = 2 * e, e + gb
    if zero >= 2 and not grads_sharded(zero, micro_batches, defer):  # deferred: one reduce a step
        return (gather, gather, reduce) if zero == 3 else (0, 0, gather + reduce)
    if zero == 3:
        return gather, gather + reduce, 0
    if zero == 2:
        return 0, reduce, gather
    return 0, 0, (gather if zero == 1 else 0) + reduce


def optimizer_step_bytes(t) -> int:
    """HBM bytes per parameter the optimizer step moves on the parameters a rank updates.

    A fused AdamW kernel (the runtime's, torch's _fused_adamw_; apex's, DeepSpeed's, Megatron-LM's)
    reads the parameter it updates (the float32 master copy under mixed precision), its gradient
    and both float32 moments, and writes the parameter and moments back in one pass: 2 p + g + 16
    bytes, 28 for float32 parameters and gradients (16-bit moments, adam_state_bytes: 2 p + g + 8);
    in place, it allocates nothing. (torch's
    foreach AdamW, the runtime's until session 50, runs eight passes, 4 p + 3 g + 56 bytes: on an
    H200, benchmarks/gpu_check.py of 2026-11-30, its kernels and the clipping's took 28.8 ms for
    1.24e9 float32 parameters, 96 bytes a parameter at 4.14 TB/s, the copy bandwidth measured
    there; and it materializes sqrt(exp_avg_sq) for every parameter of a group at once, 4 bytes
    each: 32 MiB for 8.4 M parameters on CPU, where the fused kernel took none at 0.22-0.27x the time.)

    Either way clipping reads the gradients for their norm and scales them in place (3 passes).
    Gradients held in 16 bits under mixed precision are first copied into float32 (2 + 4), fp16
    training unscales them and checks them for inf/NaN (2 passes; loss scaling: Micikevicius et al.
    2018), and a master copy ends the step by writing the 16-bit parameters (4 + 2); the runtime
    keeps no 16-bit copy to write (autocast casts at each use, FSDP2 as it gathers)."""
    e = DTYPES[t.dtype]
    mixed = t.master_weights and e == 2
    p = updated_bytes(t)  # what AdamW updates
    g = 4 if mixed else grad_bytes(t)  # the gradient it reads
    s = adam_state_bytes(t) // 2  # one moment
    eager = t.elementwise_kernels == "eager"
    n = 2 * p + g + 4 * s + 3 * g
    if mixed and grad_bytes(t) == 2:
        n += 2 + 4
    if t.dtype == "fp16":
        n += 2 * g
    if mixed and not eager:
        n += 4 + e
    return n


def casts_weights(t, dp: int) -> bool:
    """Whether the runtime computes in 16 bits by autocast on float32 weights: mixed precision
    without data parallelism (with it, FSDP2 gathers 16-bit weights), eager kernels (frameworks
    with fused kernels keep 16-bit working weights)."""
    return dp <= 1 and t.elementwise_kernels == "eager" and t.master_weights and DTYPES[t.dtype] == 2


def autocast_cast_bytes(t, dp: int) -> tuple[int, int]:
    """(forward, backward) bytes per weight of a matrix product and per micro-batch that casting
    the weights to 16 bits moves, in the runtime without data parallelism: it keeps float32
    weights and computes in bf16 by autocast (runtime.train), so each micro-batch's forward casts
    every weight it multiplies by (reads 4 bytes, writes e) and its backward casts the weight's
    16-bit gradient back to float32 (ToCopyBackward: reads e, writes 4), again for every
    micro-batch (the autocast weight cache is off). With data parallelism FSDP2 gathers 16-bit
    weights instead (fsdp_copy_bytes); frameworks with fused kernels keep 16-bit working weights."""
    e = DTYPES[t.dtype]
    return (4 + e, e + 4) if casts_weights(t, dp) else (0, 0)


def keeps_shards(t, tp: int, sp: bool) -> bool:
    """Whether sequence parallelism keeps the shards of what it gathers for the column-parallel
    linears (training.sp_saved_inputs "shard", runtime.sp_shard) rather than the gathered inputs."""
    return sp and tp > 1 and t.sp_saved_inputs == "shard"


def autocast_held_bytes(model, t, dp: int, index: int, recompute: str, b: int, s: int, tp: int, sp: bool,
                        matmul_params: float) -> float:
    """Bytes a layer holds from forward to backward per micro-batch in the runtime without data
    parallelism under mixed precision (casts_weights) beyond ModelConfig.activation_bytes,
    which counts every saved tensor in the compute dtype: there the embedding's float32 weights
    make the residual stream float32, so each norm (and a fully recomputed block) keeps a float32
    input; autocast casts a norm's float32 output afresh for each linear that reads it (q, k, v,
    and w1, w3 in a gated FFN; ModelConfig counts one such input per norm) and keeps each cast;
    and each linear keeps its 16-bit weight (e bytes per weight of a matrix product), for every
    micro-batch in flight. On an H200 (benchmarks/gpu_check.py, 2026-11-30, Llama 3.2 1B's shape at
    sequence 2048) a block measured 230.7 MB per sequence plus 122.7 MB, against 231.0 and 121.6
    counted this way (ModelConfig alone: 189.0 and none)."""
    if not casts_weights(t, dp):
        return 0.0
    e = DTYPES[t.dtype]
    kind = model.layer_kind(index)
    stream = s * b * model.hidden / (tp if sp else 1)  # residual-stream elements on this device
    # under sequence parallelism keeping shards (runtime.sp_shard) a module's linears keep none of
    # their casts but the float32 shard they came from, which ModelConfig counts at e bytes
    shards = keeps_shards(t, tp, sp)
    if kind == "embedding":
        return 0.0
    if kind == "head":
        return (2 if shards else 1) * (4 - e) * stream + e * matmul_params
    if recompute == "full":
        return (4 - e) * stream  # the block's float32 input alone
    if shards:
        return 4 * (4 - e) * stream + e * matmul_params
    casts = 3 + (2 if model.arch == "llama" else 1)  # linears reading a norm's output
    # each cast is of the linear's input: the whole sequence where sequence parallelism gathers it
    cast = s * b * model.hidden if sp and tp > 1 else stream
    return 2 * (4 - e) * stream + (casts - 2) * e * cast + e * matmul_params


def sp_gathered_bytes(model, t, index: int, recompute: str, b: int, s: int, tp: int, sp: bool,
                      replay: bool = False) -> float:
    """Bytes a layer holds from forward to backward per micro-batch under sequence parallelism
    beyond ModelConfig.activation_bytes, which counts the inputs of the column-parallel linears
    (the block's two projection inputs, the head's input) as Korthikanti et al. 2022 (section
    4.2.2) and Megatron-LM keep them: one sequence shard each, all-gathered again in the backward.
    The runtime's DTensor tensor parallelism gathers the input before the linear (PrepareModuleInput
    with Replicate, ColwiseParallel) and the matrix product keeps the gathered tensor
    (training.sp_saved_inputs "gathered"): tp - 1 more shards each. Measured on the tiny model
    (model profiles, CPU): a block kept 64 KB more at TP 2 and 93 KB at TP 4 than the shard
    accounting counts, against 66 and 98 KB this adds. A fully recomputed block's replay
    (`replay`) keeps them whole either way: runtime.sp_shard stays out of torch's checkpoint."""
    if not sp or tp <= 1:
        return 0.0
    kind = model.layer_kind(index)
    inputs = {"embedding": 0, "head": 1, "block": 0 if recompute == "full" else 2}[kind]
    if keeps_shards(t, tp, sp) and not replay:  # an MoE block's experts read its MLP input whole (runtime.moe)
        inputs = 1 if kind == "block" and model.moe is not None and recompute != "full" else 0
    return inputs * DTYPES[t.dtype] * s * b * model.hidden * (1 - 1 / tp)


def decomposed_norm_bytes(model, t, dp: int, index: int, recompute: str, b: int, s: int, tp: int,
                          sp: bool) -> float:
    """Bytes a layer of the runtime on CPU (gloo clusters: runtime/device.py) holds from forward to
    backward for its RMSNorms beyond ModelConfig.activation_bytes, which counts a norm's input as
    the fused kernel keeps it (aten::_fused_rms_norm, CUDA only in torch 2.13). On CPU F.rms_norm
    runs as its composite and keeps x in float32 (a float32 copy where the stream is 16-bit) and
    the float32 x * rstd for the weight's gradient; traced with saved-tensor hooks: fp32 x, rstd,
    x * rstd; bf16 x, float32 x, rstd, x * rstd. Two norms a block (none kept under full
    recomputation, which keeps the block's input alone), the final norm in the head; Qwen3's norms
    of each q and k head alike, on the projections' outputs (16-bit under autocast too)."""
    kind = model.layer_kind(index)
    if model.arch != "llama" or t.elementwise_kernels != "eager" or kind == "embedding" \
            or (kind == "block" and recompute == "full"):
        return 0.0
    e = 4 if casts_weights(t, dp) else DTYPES[t.dtype]  # the stream's bytes (autocast: float32, counted there)
    stream = s * b * model.hidden / (tp if sp else 1)
    qk = s * b * (model.q_dim + model.kv_dim) / tp * (8 - DTYPES[t.dtype]) if kind == "block" and model.qk_norm else 0
    return (2 if kind == "block" else 1) * (4 + 4 - e) * stream + qk


# Host bytes torch's autograd keeps per layer and micro-batch beside the tensors it saves: its
# graph's nodes and saved-variable records, freed by the backward. On a GPU they are host memory;
# on CPU (gloo clusters) they are the device's. Measured here (torch 2.13, CPU, runtime.model's
# layers; heap growth of a forward less the bytes of its saved tensors and output, repeated: see
# tests/test_first_backward.py) independent of the layer's size: a Llama block 62-65 KiB without
# recomputation, 65-69 selective, 48 full; a GPT block 41-48, 48-52, 33-35; an embedding 1-4; a
# head 7-14. Kept here as the largest, rounded up, for either architecture.
CPU_GRAPH_BYTES = {("block", "none"): 72 * 1024, ("block", "selective"): 76 * 1024, ("block", "full"): 52 * 1024,
                   ("embedding", "none"): 4 * 1024, ("head", "none"): 16 * 1024}
# An MoE block's (runtime.moe) more, per expert and for a shared expert, measured alike on tiny with
# 4 to 16 experts: 10.1 KiB an expert without recomputation, 6.3 under full recomputation (whose
# checkpoint keeps the nodes), a shared expert 14-16 KiB; rounded up
CPU_GRAPH_EXPERT_BYTES = {"none": 11 * 1024, "selective": 11 * 1024, "full": 7 * 1024}
CPU_GRAPH_SHARED_BYTES = 16 * 1024
# Qwen3's per-head q and k norms (decomposed on CPU, decomposed_norm_bytes), measured alike on tiny:
# 7.5-8.0 KiB more a block without recomputation, 14.2-15.5 selective, 8.0-8.1 full; rounded up
CPU_GRAPH_QK_NORM_BYTES = {"none": 9 * 1024, "selective": 16 * 1024, "full": 9 * 1024}


# Attention-probability dropout on CPU: scaled_dot_product_attention has no fused kernel with
# dropout there and runs its math path, which keeps the probabilities, the float mask and the
# dropped probabilities: 13 bytes per (sequence, head, query, key) in float32, 14 in bf16 (torch
# 2.13, measured in tests/test_dropout.py), where the fused kernel keeps a log-sum-exp per query.
CPU_MATH_DROPOUT_BYTES = 14


def cpu_held_bytes(model, t, dp: int, index: int, recompute: str, b: int, s: int, tp: int, sp: bool) -> float:
    """What a layer of the runtime on CPU holds from forward to backward beyond what it holds on a
    GPU: decomposed_norm_bytes, its autograd graph's records (CPU_GRAPH_BYTES) and attention dropout's
    probabilities (CPU_MATH_DROPOUT_BYTES)."""
    kind = model.layer_kind(index)
    graph = CPU_GRAPH_BYTES[(kind, recompute if kind == "block" else "none")]
    if kind == "block" and model.moe is not None:
        graph += (CPU_GRAPH_EXPERT_BYTES[recompute] * model.moe.experts
                  + (CPU_GRAPH_SHARED_BYTES if model.moe.shared_ffn_hidden else 0))
    if kind == "block" and model.qk_norm:
        graph += CPU_GRAPH_QK_NORM_BYTES[recompute]
    math = 0.0
    if kind == "block" and recompute == "none" and t.attention_dropout_p > 0 and t.attention != "unfused":
        math = CPU_MATH_DROPOUT_BYTES * model.heads / tp * s * s * b
    return decomposed_norm_bytes(model, t, dp, index, recompute, b, s, tp, sp) + graph + math


def runtime_held_bytes(model, t, dp: int, index: int, recompute: str, b: int, s: int, tp: int, sp: bool,
                       matmul_params: float, cpu: bool, replay: bool = False) -> float:
    """What a layer of the runtime holds from forward to backward per micro-batch beyond
    ModelConfig.activation_bytes: autocast's float32 inputs and casts, the inputs sequence
    parallelism gathers, and on CPU (`cpu`: gloo clusters) cpu_held_bytes. `replay`: what a fully
    recomputed block's replay holds (recompute "none")."""
    return (autocast_held_bytes(model, t, dp, index, recompute, b, s, tp, sp, matmul_params)
            + sp_gathered_bytes(model, t, index, recompute, b, s, tp, sp, replay)
            + (cpu_held_bytes(model, t, dp, index, recompute, b, s, tp, sp) if cpu else 0.0))
