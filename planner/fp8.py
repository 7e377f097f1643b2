"""FP8 linear layers (training.fp8): a block's linear products computed on FP8 tensor cores, the
rest of the step in the plan's 16-bit dtype.

Every FP8 recipe in use runs the three GEMMs of a linear layer, the forward (input x weight), the
input gradient (output gradient x weight) and the weight gradient (input x output gradient), with
both operands in 8 bits (E4M3 forward; E4M3 or E5M2 gradients: Micikevicius et al., "FP8 formats
for deep learning", 2022) and 16- or 32-bit outputs; attention, norms, the embedding and the
output head stay in 16 bits (TransformerEngine's fp8_autocast over Megatron-LM's transformer
layers, whose output layer is not a TransformerEngine module; torchao's convert_to_float8_training
as torchtitan calls it, its filter leaving out the output projection). An MoE block's router and
shared-expert gate stay in 16 bits too (their outputs are a few columns wide).

Priced per FP8 product (planner.layers.layer_cost): the three GEMMs at the device's FP8 rate for
their shape (fp8_rate: the sustained curve device.matmul_flops_by_size.fp8 where the profile has
one, Azure's cuBLASLt sweeps after 10,000 warm-up products for H100, H200 and GB200; else
peak_flops.fp8 x matmul_efficiency.fp8, Bekman's MAMF table, for B200 and B300; an A100 has no FP8
tensor cores and refuses the option), reading 8-bit operands; and the
casts of its three operands, the input (once where two products share it: SwiGLU's gate and up),
the weight and the output gradient, memory-bound kernels moving CAST_BYTES[recipe] bytes per
16-bit element (cast_bytes):
- `tensorwise`: a scale per tensor from the tensor's own amax, computed before the cast (torchao
  Float8Linear's dynamic tensorwise recipe, torchtitan's float8 default): the amax pass reads the
  tensor (2), the cast reads it again (2) and writes the 8-bit copy (1) and the transposed 8-bit
  copy the other GEMM reads (1; Hopper's FP8 GEMMs take only K-major operands): 6, eager. With
  fused elementwise kernels (training.elementwise_kernels: torch.compile, TransformerEngine) the
  amax is a reduction over the tensor its producer writes, computed in that kernel (Inductor fuses
  a reduction into the pointwise kernel it reads from; cuBLASLt returns a GEMM output's amax from
  its epilogue), so the pass's two bytes go: 4. Weights are cast each micro-batch.
- `current`: TransformerEngine's Float8CurrentScaling, the same per-tensor amax before the cast
  (6 eager, 4 fused), its weights' 8-bit copies cast at the first micro-batch and kept for the
  step (Megatron-LM passes is_first_microbatch to its TransformerEngine layers: megatron/core/
  extensions/transformer_engine.py, TELinear.forward).
- `delayed`: TransformerEngine's DelayedScaling, the scale taken from earlier steps' amax history,
  so one pass reads (2) and writes both copies (1 + 1), recording the amax as it goes: 4; weights
  cached for the step.
- `mxfp8`: the OCP microscaling format (a power-of-two scale per 32 elements, computed in the cast
  kernel), Blackwell's tensor cores: one pass reads (2) and writes the row-wise and column-wise
  copies (1 + 1) and their scales (2 / 32): 4.0625; weights cached for the step.

Memory: TransformerEngine's recipes (current, delayed, mxfp8) keep each linear's input for the
weight gradient as its 8-bit copy (its Linear and LayerNormLinear save the quantized input), one
byte an element where the 16-bit model keeps two (saved_input_bytes_less); torchao's tensorwise
keeps the 16-bit input and weight and casts them again in the backward, its casts' traffic priced
once here. The cached recipes' weight copies: fp8_weight_bytes. FP8 parameters
(training.fp8_param_gather: Megatron-LM's --fp8-param-gather holds them in 8 bits and its
distributed optimizer all-gathers them so; torchtitan's enable_fsdp_float8_all_gather gathers
them so): fp8_weight_bytes, gathered_bytes_per_param.

Sequence parallelism's all-gathers move 8-bit tensors (gathered_act_bytes). Priced as the 16-bit
model prices it (on the slow side where it matters): casts fused into a preceding norm
(TransformerEngine's LayerNormLinear). The runtime does not train in FP8: `trident run` refuses
these plans (runtime.run_checks.PREDICTION_ONLY).
"""
from __future__ import annotations

from planner.model import ConfigError

FP8_RECIPES = ("tensorwise", "current", "delayed", "mxfp8")
CAST_BYTES = {"tensorwise": 6.0, "current": 6.0, "delayed": 4.0, "mxfp8": 4.0 + 2.0 / 32}  # per 16-bit element
AMAX_PASS = {"tensorwise": 2.0, "current": 2.0, "delayed": 0.0, "mxfp8": 0.0}  # of it, an unfused amax's read
WEIGHTS_CACHED = {"tensorwise": False, "current": True, "delayed": True, "mxfp8": True}  # cast once a step


def cast_bytes(recipe: str, elementwise_kernels: str) -> float:
    """Bytes a cast to FP8 moves per 16-bit element under `recipe`, the amax's read fused into the
    producer with fused elementwise kernels (module doc)."""
    return CAST_BYTES[recipe] - (AMAX_PASS[recipe] if elementwise_kernels != "eager" else 0.0)


def fp8_rate(device):
    """The device's FP8 GEMM rate, a function (M, N, K) -> FLOP/s (DeviceSpec.gemm_flops_per_s:
    its sustained curve where the profile has one, else peak x matmul_efficiency); a ConfigError
    naming the field where the device has no FP8 rate."""
    if "fp8" not in device.peak_flops:
        raise ConfigError(f"training.fp8: the profile's device ({device.name or 'unnamed'}) gives no FP8 rate "
                          "(device.peak_flops.fp8; FP8 tensor cores start with Hopper); plan without --fp8, or "
                          "add peak_flops.fp8 and matmul_efficiency.fp8 to the profile")
    return lambda M, N, K: device.gemm_flops_per_s("fp8", M, N, K)


def is_fp8_product(model, gemm: tuple) -> bool:
    """Whether a block product of model.block_gemms (not attention's two, which the caller drops)
    runs in FP8: all but an MoE block's router (experts columns) and shared-expert gate (one)."""
    count, _, N, K = gemm
    return not (model.moe is not None and count == 1 and K == model.hidden and N in (model.moe.experts, 1))


def shared_input(model, gemm: tuple) -> int:
    """How many of a product's `count` calls read the same input, cast once: SwiGLU's gate and up
    projections (llama blocks list them as one product of an even count), else 1."""
    return 2 if model.arch == "llama" and gemm[0] % 2 == 0 else 1


def fp8_gemm_time(gemm: tuple, rate, bw: float) -> float:
    """Roofline time of a forward product (count, M, N, K) on FP8 tensor cores at fp8_rate's `rate`
    for its shape (a batched call sized as one product `count` times as tall, as
    planner.layers.gemm_time): 8-bit operands in, a 16-bit output. The backward's two products
    each take as long (the caller's rule for every product)."""
    c, M, N, K = gemm
    return c * max(2.0 * M * N * K / rate(c * M, N, K), (M * K + K * N + 2.0 * M * N) / bw)


def fp8_cast_times(model, t, gemms: list, device, micro_batches: int) -> tuple[float, float]:
    """(forward, backward) seconds of the casts of a block's FP8 products' operands on one rank
    and micro-batch (module doc): the inputs and weights forward, the output gradients backward.
    A recomputed forward casts again, as the caller replays it."""
    per_elt = cast_bytes(t.fp8, t.elementwise_kernels)
    weight_share = 1.0 / micro_batches if WEIGHTS_CACHED[t.fp8] else 1.0
    inputs = weights = grads = 0.0
    for g in gemms:
        if is_fp8_product(model, g):
            c, M, N, K = g
            inputs += c / shared_input(model, g) * M * K
            weights += c * K * N
            grads += c * M * N
    return (device.pointwise_seconds(per_elt * (inputs + weight_share * weights)),
            device.pointwise_seconds(per_elt * grads))


def fp8_weight_bytes(t, block_params: float) -> float:
    """Bytes a rank holds for the step of its blocks' FP8 weight copies where the recipe keeps them
    from the first micro-batch on (WEIGHTS_CACHED): the 8-bit copy and its transpose (MXFP8: its
    row-wise and column-wise copies), 2 bytes a parameter, of `block_params` (the norms' few
    counted too). Nothing under tensorwise, whose casts live while their layer computes, nor under
    fp8_param_gather, where the two 8-bit copies are the parameters, in place of a 16-bit one."""
    return 2.0 * block_params if t.fp8 and WEIGHTS_CACHED[t.fp8] and not t.fp8_param_gather else 0.0


def gathered_bytes_per_param(t, e: int, params: float, fp8_params: float) -> float:
    """Bytes a parameter that data parallelism all-gathers (ZeRO 1-3) moves, over a stage of
    `params` of which `fp8_params` are FP8 linears' weights: e, or one for those under
    fp8_param_gather (Megatron-LM's distributed optimizer and torchtitan's FSDP2 gather them in
    8 bits)."""
    if not (t.fp8 and t.fp8_param_gather) or not params:
        return float(e)
    return e - (e - 1) * fp8_params / params


def gathered_act_bytes(model, t, kind: str, act_bytes: float, e: int) -> float:
    """What a layer's sequence-parallel all-gathers move: act_bytes (16-bit), or under FP8 linears
    a dense block's the column-parallel linears' inputs and, in the backward, the row-parallel ones'
    output gradients, each quantized before it is gathered, a byte an element (MXFP8: and its
    scales), as TransformerEngine gathers them (gather_along_first_dim with the input's or the
    gradient's quantizer: module/layernorm_linear.py, module/base.py grad_output_preprocess) and
    torchtitan's Float8 tensor parallelism does. The reduce-scatters of the GEMMs' 16-bit outputs
    stay as they are; an MoE block's gathers too (its router reads the input in 16 bits)."""
    if not t.fp8 or kind != "block" or model.moe is not None:
        return act_bytes
    return act_bytes / e * (1.0 + (1.0 / 32 if t.fp8 == "mxfp8" else 0.0))


def saved_input_bytes_less(model, t, b: float, s: int, tp: int, sp: bool, e: int) -> float:
    """Bytes a dense block keeps less for its backward where the recipe saves its linears' inputs
    in 8 bits (TransformerEngine's: not tensorwise; module doc): QKV's and the first MLP
    projection's inputs (the norms' outputs, whole on each TP rank unless sequence parallel), the
    output projection's (the attention output) and the second projection's (SwiGLU's product, or
    GELU's output), each e - 1 bytes an element less than planner.model.activation_bytes counts
    them. None for MoE blocks (their experts' rows are counted apart: planner.moe)."""
    if not t.fp8 or t.fp8 == "tensorwise" or model.moe is not None:
        return 0.0
    tokens = b * s
    return (e - 1) * tokens * (2 * model.hidden / (tp if sp else 1) + (model.q_dim + model.ffn_hidden) / tp)
