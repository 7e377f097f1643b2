"""What each published source states or its framework implies beyond its CSV rows (attention kernel,
dropout, elementwise kernels, FSDP copies, ZeRO levels to try) and what its launch scripts set per
model (RUN_SETTINGS), each with its source: benchmarks/published.py builds every row's plan with them."""
from __future__ import annotations

# published/trained before May 2022 (FlashAttention); Korthikanti et al. 2022 (arXiv 2205.05198,
# May 2022) ran Megatron-LM's own softmax kernels
BEFORE_FLASH_ATTENTION = {"megatron-sc21-table1", "mt-nlg-530b", "korthikanti-2022-table5", "korthikanti-2022-section6",
                          "bigscience-tr11-2022"}
# What each source states (or its framework implies) beyond its rows, one entry per source; the
# defaults, for sources not listed, are in source_settings.
# - attention: before FlashAttention (BEFORE_FLASH_ATTENTION) a materialized softmax; MosaicML's
#   benchmark sets the MPT model's attn_impl to its --attn_impl, default "triton"
#   (submit_benchmarks.py at b2a43a147), the Triton FlashAttention kernel.
# - dropout: Megatron-LM's default 0.1 for GPT runs, none for Llama; MPT's dropouts (attn_pdrop,
#   resid_pdrop, emb_pdrop) default to 0.
# - elementwise_kernels (planner.pointwise): Megatron-LM (and Megatron-DeepSpeed, MT-NLG's model
#   code) runs fused kernels (megatron/fused_kernels: scale + mask + softmax, layer norm; bias + GeLU
#   and bias + dropout + add fused by the JIT); MPT's blocks are native LayerNorm (low_precision_
#   layernorm) and GELU kernels with a fused Wqkv, what `fused` counts; Llama 3 does not say, and a
#   400 TFLOP/s run fuses its norms and rotary embeddings. torchtitan's blocks are eager PyTorch as
#   trident's are: rotary embeddings as a complex multiply in float32, SwiGLU as silu and a
#   product; its train configs at that commit set norm_type "fused_rmsnorm" (a Triton kernel) for
#   the 13B model and "rmsnorm" (eager) for the 70B ones, which the 70B rows (FSDP only, unlike
#   those configs' TP 8) may or may not have kept. NeMo AutoModel's recipe compiles the model
#   (enable_compile): Inductor fuses its norms, rotary embeddings and SwiGLU, what `fused` counts.
#   Megatron-LM's loss, where nothing says it was fused, is its default (`fused-fp32-loss`):
#   vocab_parallel_cross_entropy on the logits cast to float32, op by op (megatron/mpu/
#   cross_entropy.py and the models' `vocab_parallel_cross_entropy(output.float(), labels)` unless
#   --fp16-lm-cross-entropy, in 2021-2022 Megatron-LM and Megatron-DeepSpeed; megatron/core/
#   tensor_parallel/cross_entropy.py, whose fused form only --cross-entropy-loss-fusion turns on:
#   cross_entropy_loss_fusion defaults to False in megatron/core/model_parallel_config.py). The
#   Megatron-Core runs' READMEs do not name that flag; NeMo's and Megatron-Bridge's GPT configs
#   default it to True, and keep `fused`.
# - fsdp_copies (planner.precision.fsdp_copy_bytes): torchtitan and NeMo AutoModel run FSDP2, as
#   trident's runtime does; Megatron-LM's DDP, DeepSpeed's ZeRO and PyTorch's FSDP1 (MosaicML) gather into and reduce
#   from flat buffers.
# - zeros: Megatron-LM in 2021 had no ZeRO (Narayanan et al. SC'21 compare against ZeRO-3
#   separately); MT-NLG used DeepSpeed's ZeRO stage 1 with its pipeline; MosaicML's rows ran FSDP
#   FULL_SHARD, torchtitan's and NeMo AutoModel's FSDP2 resharding after forward (ZeRO-3); Llama 3
#   does not say: search.
# - selective_recompute (planner.sac): what a "selective" row replays; torchtitan's "selective op"
#   (its per-op policy: every second matrix product and what is not a product or attention) in its
#   own runs, Korthikanti et al.'s attention core elsewhere.
# - master_weights (training.master_weights): every source keeps fp32 master weights but
#   KempnerForge, whose build_parallel_model casts the model to its param_dtype, bf16, after
#   sharding (kempnerforge/distributed/parallel.py at 01b461a, the commit its MFU report names):
#   bf16 weights, gradients and AdamW moments (its single-GPU run's 80.7 GB for 8.03B parameters),
#   FSDP2 reducing in fp32 (default_mp_policy): master_weights false, adam_moments param_dtype (its
#   AdamW's moments are zeros_like the bf16 parameters). Its scripts/train.py compiles the model
#   (torch.compile; the report's runs but one), what `fused` counts.
# - defer_grad_sync (training.defer_grad_sync): KempnerForge's FSDP2 accumulation turns the gradient
#   sync off but on the last micro-batch (kempnerforge/training/grad.py maybe_no_sync at 01b461a:
#   model.set_requires_gradient_sync(False)); the others reduce-scatter every micro-batch's.
_MEGATRON_LOSS = "fused-fp32-loss"  # fused blocks, Megatron-LM's default float32 loss (above)
SOURCES = {
    "megatron-sc21-table1": dict(elementwise_kernels=_MEGATRON_LOSS, zeros=(0,)),
    "mt-nlg-530b": dict(elementwise_kernels=_MEGATRON_LOSS, zeros=(1,)),
    "korthikanti-2022-table5": dict(elementwise_kernels=_MEGATRON_LOSS, zeros=(0,)),
    "korthikanti-2022-section6": dict(elementwise_kernels=_MEGATRON_LOSS, zeros=(0,)),
    "mosaicml-llm-foundry-2023": dict(attention="flash-triton", dropout=0.0, zeros=(3,)),
    "torchtitan-2024": dict(elementwise_kernels="eager", fsdp_copies=True, zeros=(3,), selective_recompute="ops"),
    "bigscience-tr11-2022": dict(elementwise_kernels=_MEGATRON_LOSS, zeros=(1,)),
    "megatron-core-v0.8": dict(elementwise_kernels=_MEGATRON_LOSS, zeros=(1,)),
    "megatron-core-v0.9": dict(elementwise_kernels=_MEGATRON_LOSS, zeros=(1,)),
    "megatron-core-r0.8-h100": dict(elementwise_kernels=_MEGATRON_LOSS, zeros=(1,)),
    "nemo-automodel-2026": dict(fsdp_copies=True, zeros=(3,)),
    "torchtitan-trainy-2025": dict(fsdp_copies=True, zeros=(3,), selective_recompute="ops"),
    "torchtitan-2024-12": dict(fsdp_copies=True, zeros=(3,), selective_recompute="ops"),
    "torchtitan-2025-06": dict(fsdp_copies=True, zeros=(3,), selective_recompute="ops"),
    "torchao-2025-03": dict(fsdp_copies=True, zeros=(3,), selective_recompute="ops"),
    "kempnerforge-2026-04": dict(fsdp_copies=True, master_weights=False, adam_moments="param_dtype",
                                 defer_grad_sync=True),
}


def source_settings(source: str, arch: str) -> dict:
    """attention, dropout, elementwise_kernels, fsdp_copies, selective_recompute, master_weights,
    adam_moments, defer_grad_sync and the ZeRO levels to try for a source."""
    return {"attention": "unfused" if source in BEFORE_FLASH_ATTENTION else "flash", "selective_recompute": "attention",
            "dropout": 0.1 if arch == "gpt" else 0.0, "elementwise_kernels": "fused", "fsdp_copies": False,
            "master_weights": True, "adam_moments": "fp32", "defer_grad_sync": False, "zeros": (0, 1, 2, 3),
            **SOURCES.get(source, {})}


# Megatron-LM's scripts for the SC21 paper, examples/sc21/run_table_1.sh at tag v2.6 (commit
# 3860e99526, 2021-08-27; added in de7dc40f88 "scripts for sc21"): per model size MBS,
# --num-layers-per-virtual-pipeline-stage (v = layers / pp / that) and --DDP-impl. `torch` is
# PyTorch DDP, whose bucketed all-reduce overlaps the backward; `local` is Megatron's own DDP,
# which all-reduces the gradient buffer from train_step after forward_backward_func returns
# (megatron/training.py and megatron/model/distributed.py at tag v2.5): not overlapped.
_SC21 = {  # model: (micro_batch, virtual_stages, DDP impl)
    "gpt-1.7b": (16, 1, "torch"), "gpt-3.6b": (16, 1, "torch"), "gpt-7.5b": (16, 1, "torch"),
    "gpt-18.4b": (8, 1, "torch"), "gpt-39.1b": (4, 1, "local"), "gpt-76.1b": (2, 3, "local"),
    "gpt-145.6b": (2, 2, "local"), "gpt-310.1b": (1, 2, "local"), "gpt-529.6b": (1, 3, "local"),
    "gpt-1008b": (1, 1, "local")}
# Pipeline transfers: Megatron-LM's --scatter-gather-tensors-in-pipeline is on by default at tag
# v2.5 (megatron/arguments.py; megatron/p2p_communication.py splits the tensor over the TP ranks and
# all-gathers it on arrival; SC'21 section 4.1).
# Gradients of fp16 runs add up in fp16: local DDP's main_grad buffer takes the parameter's dtype
# unless --accumulate-allreduce-grads-in-fp32 (megatron/model/distributed.py at v2.5), PyTorch DDP
# accumulates into the fp16 .grad.
RUN_SETTINGS = {("megatron-sc21-table1", m): dict(micro_batch=b, virtual_stages=v, overlap_grad_reduce=ddp == "torch",
                                                  p2p="scatter-gather", grad_accumulation="separate-16bit")
                for m, (b, v, ddp) in _SC21.items()}
# MT-NLG trained with DeepSpeed's pipeline engine (Smith et al. 2022, section 2.3): its
# TrainSchedule issues ReduceGrads after the last micro-batch (not overlapped) and runs the
# 1F1B steps in lock-step with blocking neighbour send/recv (deepspeed/runtime/pipe/schedule.py
# and p2p.py at tag v0.5.8, 2021-11-30); its ZeRO stage 1 all-gathers the updated parameters inside
# the optimizer step, right after the update ("gather the updated weights from everyone",
# deepspeed/runtime/zero/stage2.py).
# Its engine partitions the tensors it sends between stages over the TP group (is_pipe_partitioned
# and is_grad_partitioned whenever model parallel, deepspeed/runtime/pipe/engine.py at v0.5.8).
# It trained "with mixed precision using 16-bit bfloat" (Smith et al. 2022, arXiv 2201.11990,
# "Hardware System"), where the CSV says fp16: DeepSpeed v0.5.8 runs bf16 only under ZeRO, whose
# stage 1 with a pipeline lets each micro-batch's gradients add up in the bf16 .grad until
# ReduceGrads (deepspeed/runtime/zero/stage2.py, reduce_gradients), as fp16 ones would, without a
# loss scale; the A100 runs both at the same rate: the three predictions move by under 0.01%.
RUN_SETTINGS[("mt-nlg-530b", "mt-nlg-530b")] = dict(overlap_grad_reduce=False, overlap_param_gather=False, lockstep=True,
                                                     p2p="scatter-gather", grad_accumulation="separate-16bit",
                                                     dtype="bf16")
# BLOOM's runs (BLOOM_CSV): the same engine; fp16 gradients add up in fp16, the BF16 optimizer's in fp32
for _m, _acc in (("tr11-fp16", "separate-16bit"), ("tr11-bf16", "separate-fp32")):
    RUN_SETTINGS[("bigscience-tr11-2022", _m)] = dict(RUN_SETTINGS[("mt-nlg-530b", "mt-nlg-530b")],
                                                       grad_accumulation=_acc, dtype=None)
# Korthikanti et al. 2022, section 6: "three interleaving stages (m = 3) for the 175B and 530B
# models" (the 1T model without interleaving), and section 6.3: "we do not use any overlapping of
# gradient all-reduces with back-propagation". Megatron-LM then (main at 2022-05-15, commit 35a3fa8)
# runs the backward's TP all-reduces beside the weight-gradient GEMMs by default
# (--no-async-tensor-model-parallel-allreduce to disable; since 2021-09-02, commit 16c90445e7,
# after the SC'21 scripts), keeps scatter/gather pipeline transfers on, and for bf16 (which forces
# fp32 gradient accumulation) adds each micro-batch's weight gradient inside its GEMM
# (--no-gradient-accumulation-fusion to disable; megatron/arguments.py at that commit).
for _src in ("korthikanti-2022-table5", "korthikanti-2022-section6"):
    for _m, _v in (("gpt-22b", 1), ("gpt-175b", 3), ("gpt-530b", 3), ("gpt-1t", 1)):
        RUN_SETTINGS[(_src, _m)] = dict(virtual_stages=_v, overlap_grad_reduce=False, p2p="scatter-gather",
                                        async_tp_allreduce=True, grad_accumulation="fused")


# Megatron-Core's MoE rows (MOE_CSV): interleaved 1F1B with one block a chunk (VP 8 of 32 blocks
# over PP 4); the distributed optimizer (ZeRO 1) with --overlap-grad-reduce and --overlap-param-gather
# (the parameters gathered in the next forward), as the README's Mixtral
# training example sets; gradient accumulation fused into the weight-gradient GEMMs (TransformerEngine's
# GroupedLinear "support Gradient Accumulation Fusion", the same README; Megatron-LM's default for bf16)
for _src in ("megatron-core-v0.8", "megatron-core-v0.9"):
    RUN_SETTINGS[(_src, "mixtral-8x7b")] = dict(virtual_stages=8, overlap_grad_reduce=True, grad_accumulation="fused")
# Megatron-Bridge's and NeMo's performance configurations (heldout_fp8.csv, heldout_dgxc.csv: the
# sources in benchmarks/published.py and below)
_NEMO_PERF = dict(overlap_grad_reduce=True, grad_accumulation="fused-16bit", tp_comm_overlap=True)
for _src, _m in (("megatron-bridge-25.09", "llama3-8b"), ("megatron-bridge-25.11", "llama3-8b"),
                 ("megatron-bridge-25.11", "llama3-70b"), ("megatron-bridge-26.04.01", "llama3-70b"),
                 ("megatron-bridge-25.11", "llama3.1-405b"), ("megatron-bridge-26.06", "llama3.1-405b"),
                 ("megatron-bridge-26.04.01", "llama3.1-405b")):
    RUN_SETTINGS[(_src, _m)] = _NEMO_PERF
# NVIDIA's DGX Cloud benchmarking recipes (DGXC_CSV in benchmarks/published.py): every run with the
# distributed optimizer (ZeRO 1) overlapping its reductions and gathers, TP communication beside
# the GEMMs (MegatronCommOverlapCallback tp_comm_overlap=True with userbuffers, in the 70B and 405B
# recipes' pretrain_performance_optimizations; the GPT-3 config's ub_tp_comm_overlap: true), and
# gradients added up in 16-bit buffers in BF16 runs too: the performance recipes set
# grad_reduce_in_fp32 False (nemo/collections/llm/recipes/llama3_8b.py, llama3_70b.py and
# llama31_405b.py at NeMo d2b21556f and 7a8f1cc7b), the GPT-3 config grad_sync_dtype bf16
for _src, _m in (("dgxc-25.04.01", "llama3.1-8b"), ("dgxc-25.04.01", "llama3.1-70b"), ("dgxc-25.04.01", "llama3.1-405b"),
                 ("dgxc-25.04.01", "gpt3-175b"), ("dgxc-25.05", "llama3.1-405b")):
    RUN_SETTINGS[(_src, _m)] = _NEMO_PERF
# Megatron-LM's H100 weak-scaling runs (heldout_megatron_core.csv): its README names
# --overlap-grad-reduce --overlap-param-gather (which needs the distributed optimizer: ZeRO 1) and
# --tp-comm-overlap (which needs sequence parallelism); bf16 forces fp32 gradient accumulation and
# reduction, and gradient accumulation fusion is on by default (megatron/training/arguments.py at
# core_r0.8.0)
for _m in ("gpt-1.7b", "gpt-7.1b", "gpt-16b", "gpt-32b", "gpt-70b", "gpt-119b", "gpt-177b", "gpt-314b", "gpt-462b"):
    RUN_SETTINGS[("megatron-core-r0.8-h100", _m)] = dict(overlap_grad_reduce=True, grad_accumulation="fused",
                                                         tp_comm_overlap=True)
