"""Predict every published training run in shared/reference/published_runs.csv and compare.

For each row the same plan is built (`trident plan` with the row's degrees) and predicted. What a
row does not state is chosen the way the run's authors would have tuned it: the fastest setting
that fits in device memory, over the micro-batch size (where the column is empty), the number of
virtual stages (interleaved rows), the recompute mode (where empty) and the ZeRO level.
Attention is unfused (materialized softmax) for runs published before FlashAttention (Dao et al.,
May 2022) and fused after; GPT runs use Megatron-LM's default dropout of 0.1, Llama none.
Where the authors published their launch scripts or framework, the row takes what they state
(RUN_SETTINGS below, each with its source) instead of searching. None of these runs used
torch.distributed.pipelining: their pipeline receive buffers live with their micro-batch
(`pipeline.recv_buffers: in-flight`; Megatron-LM's p2p_communication and DeepSpeed's pipeline
engine allocate them per transfer), not one per micro-batch for the whole step, and keep no stage
output once sent (`pipeline.sent_outputs: freed`: Megatron-LM's deallocate_output_tensor; the
DeepSpeed rows are counted the same, as before the option existed).

Published TFLOP/s count model FLOPs the Megatron way (recomputed forward included under full
recompute); where a row gives no step time, the published step time is model FLOPs / (TFLOP/s x
GPUs). Prints per-row predicted vs published and the mean absolute percentage error.

Held out (reported apart, no target): Korthikanti et al. 2022's Megatron-LM iteration times
(heldout_runs.csv); MosaicML's llm-foundry throughput table for A100 80GB (heldout_mosaicml.csv):
MPT models of 125M to 30B parameters on 8 GPUs, FSDP FULL_SHARD (ZeRO-3), bf16, with and without
activation checkpointing, sequence lengths 512 to 65536; and torchtitan's FSDP2 runs of Llama 2
13B and 70B and Llama 3 8B and 70B on 64 A100s (heldout_torchtitan.csv), the stack trident's runtime is
built on; Llama 3 405B's context-parallel row (heldout_llama3_cp.csv); Megatron-Core's Mixtral
8x7B with expert parallelism (heldout_moe.csv); NeMo AutoModel's Llama 3 70B with context
parallelism under FSDP2 and Qwen3-30B-A3B with expert parallelism (heldout_nemo_automodel.csv);
FP8 runs of Megatron-Bridge (H100, B200, GB200) and torchtitan (H200) (heldout_fp8.csv); and NVIDIA's
DGX Cloud recipes, BF16 and FP8 runs of the same configurations on H100 and GB200 (heldout_dgxc.csv);
Megatron-Core's weak-scaling runs on H100s (heldout_megatron_core.csv); and KempnerForge's one-node
runs of a Llama 3 8B on H200s, FSDP2 and DTensor TP (heldout_kempnerforge.csv).
Not printed by default: BLOOM's Megatron-DeepSpeed runs (heldout_bloom.csv, below), on a cluster
trident cannot price from sources; `--heldout benchmarks/heldout_bloom.csv` prints them.
tests/test_published.py runs every file and keeps each within the errors the README reports.

    python benchmarks/published.py [--csv PATH] [--heldout PATH ...] [--json]
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import itertools
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from planner.cluster import load_cluster  # noqa: E402
from planner.cost import estimate  # noqa: E402
from planner.model import ConfigError, ModelConfig  # noqa: E402
from planner.build import build_plan  # noqa: E402
from planner.moe import MoESpec  # noqa: E402
from run_settings import RUN_SETTINGS, source_settings  # noqa: E402

DEFAULT_CSV = ROOT.parent / "shared" / "reference" / "published_runs.csv"
HELDOUT_CSV = ROOT / "benchmarks" / "heldout_runs.csv"
# scripts/train/benchmarking/README.md of github.com/mosaicml/llm-foundry at commit b2a43a147
# (2023-10-19, "Update_pretrain_benchmarks"), table "A100 80GB with 1600 Gbps node-node
# interconnect (RoCE)": every amp_bf16 row (all on 8 GPUs; the two 70B rows ran bf16 PURE, with
# bf16 gradient reduction, and are left out). Step time = global batch x sequence length /
# "Throughput (T/s)"; published_mfu is their MFU column. Shapes from scripts/train/yamls/pretrain/
# mpt-*.yaml at that commit (d_model, n_heads, n_layers, expansion_ratio 4, vocab 50368); the
# parameter counts trident computes for them equal the table's NumParams.
MOSAICML_CSV = ROOT / "benchmarks" / "heldout_mosaicml.csv"
# docs/performance.md of github.com/pytorch/torchtitan (commit 157a12c56, 2024-04-24): FSDP2 on 64
# A100 80GB, bf16 parameters with float32 gradient reduction (torchtitan/parallelisms/
# parallelize_llama.py at that commit), F.scaled_dot_product_attention, no torch.compile; the rows
# whose activation checkpointing trident can express: none, full (every block) and "selective op"
# (its per-op policy: planner.sac; not "selective layer", every second block). Their "WPS" is
# tokens per second per GPU, so step time = local batch x sequence length / WPS. The interconnect
# is not stated; priced as DGX A100 nodes (8 GPUs, a 200 Gb/s NIC per GPU).
TORCHTITAN_CSV = ROOT / "benchmarks" / "heldout_torchtitan.csv"
# Llama 3 405B's long-context row (Dubey et al. 2024, arXiv 2407.21783, Table 4): 16,384 H100s,
# TP 8, CP 16, PP 16, DP 8, sequences of 131,072 tokens, 16M tokens a batch (128 sequences), 380
# TFLOP/s per GPU, 38% MFU; the two 8,192-token rows of that table are in the main CSV
LLAMA3_CP_CSV = ROOT / "benchmarks" / "heldout_llama3_cp.csv"
# Megatron-Core's Mixtral 8x7B (megatron/core/transformer/moe/README.md of github.com/NVIDIA/
# Megatron-LM): "438 TFLOPS as of MCore v0.8" (commit 0b981f9c53, 2024-08-02) and "468 TFLOPS as
# of MCore v0.9" (c230e0d7c2, 2024-11-21), each file's "reference parallel mappings of MCore v0.8"
# for it: 64 H100s (8 per server, 8x400 Gbit/s InfiniBand), dropless, the all-to-all dispatcher,
# bf16, sequences of 4096, TP 1, EP 8, PP 4, VP 8, MBS 1, GBS 256; that these mappings are the
# headline figures' runs is read from the same files, not stated. TFLOP/s count Megatron's
# num_floating_point_operations (megatron/training/training.py at core_r0.8.0: top-k experts'
# MLPs, no router), within 0.01% of trident's model FLOPs for it. Recomputation not stated: searched.
MOE_CSV = ROOT / "benchmarks" / "heldout_moe.csv"
# NeMo AutoModel's pre-training table (docs/performance-summary.md of github.com/NVIDIA-NeMo/Automodel,
# commit 2013a4dd6, 2026-04-10): Llama 3 70B on 64 H100s (DGX), global batch 128, micro-batch 1,
# 8192 tokens, CP 2 x FSDP 32, 18.90 s a step; its recipe at that commit (examples/llm_pretrain/
# custom_llama3_1_70b_pretrain_benchmark_8nodes.yaml: Llama-3.1-70B, bf16, sdpa attention,
# activation_checkpointing, enable_compile, FSDP2 with prefetch) and nemo_automodel/components/
# distributed/parallelizer.py there: every decoder layer but the last resharded after forward
# (ZeRO 3), each layer's attention and MLP checkpointed (their forwards replayed: priced as full
# recomputation), torch.compile fusing the elementwise kernels. Its TFLOP/s column counts FLOPs
# its own way: the step time is compared. Qwen3 MoE 30B (Qwen3-30B-A3B) on one DGX H100: global batch
# 512, micro-batch 4, 4096 tokens, EP 8 x FSDP 8, 21.773 s; its recipe at that commit
# (examples/benchmark/configs/qwen3_moe_30b_te_deepep.yaml): activation_checkpointing (priced as full
# recomputation), TransformerEngine attention, linear and RMSNorm kernels with fused RoPE (fused
# elementwise kernels), grouped-GEMM experts, DeepEP's dispatcher, fake_balanced_gate: true (the
# balanced routing trident prices by default).
NEMO_AUTOMODEL_CSV = ROOT / "benchmarks" / "heldout_nemo_automodel.csv"
# FP8 runs (planner.fp8; heldout_fp8.csv). Megatron-Bridge's pre-training tables (docs/performance-
# summary-archive.md of github.com/NVIDIA-NeMo/Megatron-Bridge at 067f987df, lines 106, 204-217,
# 578-591, 628): Llama 3 8B, 70B and 3.1 405B on DGX H100, DGX B200 and GB200 NVL72, degrees, GBS
# and MBS as printed, step time = GBS x 8192 / (tokens/s/GPU x GPUs); the latest release of each H100
# configuration, the only B200 one (25.11), and 26.04.01's GB200 rows but its 70B FP8 one (it
# offloads 40 layers' activations to the CPU, unpriced), a rack giving 64 of its 72 GPUs to a run
# (the devices_per_node column: inferred). Their release configs (scripts/performance/configs at
# r0.1.0, v0.2.0, v0.4.2, v0.5.0): the distributed optimizer (ZeRO 1) overlapping its reductions and
# gathers, no recomputation, FP8 current scaling ("FP8-CS"; "FP8" from 26.02 on, the only FP8
# presets) or MXFP8, with FP8 parameters (fp8_param_gather), attention in BF16, TE's fused kernels,
# gradient accumulation fused into 16-bit buffers (grad_reduce_in_fp32 False: configs/llama3/
# llama3_llm_pretrain.py at v0.2.0, line 47: fused-16bit), TP communication beside the GEMMs
# (tp_comm_overlap=True, src/megatron/bridge/recipes/llama/llama3.py at v0.2.0, lines 302 and 416:
# TE userbuffers); the 25.09 H100 8B row ran Megatron-FSDP (ZeRO 3), its recipe unprinted:
# DelayedScaling, the launcher's default then (scripts/performance/argument_parser.py at r0.1.0).
# torchtitan's Trainy runs (benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md at b5bcd76c):
# Llama 3 8B on 32 and 64 H200s, FSDP over all, local batch 2, torch.compile, Float8 tensorwise
# with float8 all-gathers, per-op selective checkpointing (priced as selective: it also recomputes
# every second matmul, torchtitan's _apply_ac_to_transformer_block), tps per GPU. torchtitan's H100
# tables ran 500 W-capped 96 GB H100s, a part no profile describes: their speedups are compared
# instead (benchmarks/fp8_speedup.py).
FP8_CSV = ROOT / "benchmarks" / "heldout_fp8.csv"
# NVIDIA's DGX Cloud benchmarking recipes (github.com/NVIDIA/dgxc-benchmarking): the BF16 and FP8 step
# times of the same configuration. Release v25.04.01 (commit 85380ff), DGX H100: llama3.1/README.md,
# Llama 3.1 8B on 8 GPUs (CP 2 x DP 4), 70B on 64 (BF16 TP 4 x PP 4 x CP 2, FP8 TP 4 x PP 8, VP 5),
# 405B on 512 (TP 8 x PP 8 x CP 2, VP 8), NeMo 25.02.01 (NeMo d2b21556f: the recipes' performance
# mode, bf16_with_fp8_mixed: delayed scaling with FP8 parameters); nemo_megatron/README_175b.md,
# GPT-3 175B on 128 (TP 4 x PP 8, VP 6, sequence 2048, dropout 0.1; cfg/gpt3_175b_hydra.yaml: the
# same FP8 recipe, fp8_params). Release v25.05 (68eaf7e), GB200 NVL72: Llama 3.1 405B on 128 (TP 4 x
# PP 8 x CP 2, VP 8, GBS 64), NeMo 25.04.01 (NeMo 7a8f1cc7b: fp8_recipe "ds", delayed). Each
# configuration's smallest GPU count beyond the proxies (the tables weak-scale it); the settings
# every recipe shares are in run_settings.py.
DGXC_CSV = ROOT / "benchmarks" / "heldout_dgxc.csv"
# BigScience's BLOOM (github.com/bigscience-workshop/bigscience at 9e64ede, train/tr11-176B-ml/):
# every "Sec/it" row of chronicles-prequel.md with NHIDDEN 14336 and 64 heads (February 2022,
# fp16; each the second iteration of a run, as that file says), its rows with the final 70 layers
# after the switch to the BF16 optimizer (which accumulates gradients in fp32, same file), and the
# training run's 104.70 s at iteration 85376 (README.md; tr11-176B-ml.slurm: TP 4, PP 12, MBS 2,
# GBS 2048, 112 heads). The three one-node rows ran GBS 512 (their heading; their TFLOPs agree).
# Megatron-DeepSpeed with DeepSpeed's pipeline engine and ZeRO 1, as MT-NLG. The cluster (Jean
# Zay: A100 80GB nodes, 4 Omni-Path links each; their all_reduce_bench on 4 nodes measured 15-42
# Gbit/s, experiments/bandwidth/README.md) has no sourced profile here: priced as DGX A100 nodes,
# so its network is priced faster than it was. The training run set CUDA_LAUNCH_BLOCKING=1
# (tr11-176B-ml.slurm), which their own measurement put at up to 7% slower (chronicles-prequel.md).
BLOOM_CSV = ROOT / "benchmarks" / "heldout_bloom.csv"
# Megatron-LM's H100 weak-scaling table (README.md and images/model_table.png of github.com/NVIDIA/
# Megatron-LM, added in f2e5db402c, 2024-07-15; the figures' legend: Megatron-Core r0.8.0): GPT models
# of 1.7B to 462B parameters on 48 to 6,144 H100s, vocabulary 131,072, sequences of 4,096, TP, PP,
# DP 48 and batch as printed, per-GPU TFLOP/s (their MFU column is that over 989.4). The parameter
# counts printed are those of untied embeddings and output weights (1.75B, 7.13B, ... 461.5B), GELU
# MLPs of 4h, learned positions (Megatron's defaults). Micro-batch, virtual stages and recomputation
# are not printed: searched. TFLOP/s count num_floating_point_operations at core_r0.8.0 (no
# recomputation), which equals trident's model FLOPs for these shapes.
MEGATRON_CORE_CSV = ROOT / "benchmarks" / "heldout_megatron_core.csv"
# KempnerForge's MFU report (github.com/KempnerInstitute/KempnerForge, benchmarks/mfu_scaling/
# mfu_scaling_2026-04-05.md, its runs at commit 01b461a): Llama-3 shapes on nodes of 4 H200s (141 GB,
# NVLink; priced as the HGX H200 profile's), sequences of 4,096, full recomputation, bf16, fused AdamW,
# torch.compile, FSDP2 (dp_shard) and DTensor TP with sequence parallelism (tensor_parallel.py); each
# row's step time as its table prints it (20 steps a run; tokens/s x step time gives the batch its
# table states: micro-batch 4, 2 accumulated, per data-parallel rank). Its "7B" is Llama 3 8B's shape
# (8.03B). The six one-node runs; the eight across nodes are left out: the report names InfiniBand,
# not its rate or NICs a node.
KEMPNERFORGE_CSV = ROOT / "benchmarks" / "heldout_kempnerforge.csv"


def row_model(row) -> ModelConfig:
    arch = row["arch"]
    moe = MoESpec(int(row["experts"]), int(row["experts_per_token"])) if row.get("experts") else None
    return ModelConfig(name=row["model"], arch=arch, layers=int(row["layers"]), hidden=int(row["hidden"]),
                       ffn_hidden=int(row["ffn_hidden"]), heads=int(row["heads"]), kv_heads=int(row["kv_heads"]),
                       vocab=int(row["vocab"]), seq_len=int(row["seq_len"]), moe=moe,
                       tie_embeddings=row["tie_embeddings"] == "true" if row.get("tie_embeddings") else arch == "gpt",
                       head_dim=int(row["head_dim"]) if row.get("head_dim") else None,
                       qk_norm=row.get("qk_norm") == "true")


def candidates(row, model, gpus, framework: bool = True):
    """The settings to try for a row. With `framework` false the row's time is priced as trident's
    runtime would run it (none of the framework options of RUN_SETTINGS); its configuration
    (degrees, micro-batch, virtual stages) and memory (receive buffers in flight and sent outputs
    freed, as the published engines held them) stay the published ones, so that it still fits where
    it fitted."""
    tp, pp, dp, cp, ep = int(row["tp"]), int(row["pp"]), int(row["dp"]), int(row.get("cp") or 1), int(row.get("ep") or 1)
    gbs = int(row["global_batch"])
    per_dp = gbs // dp
    known = RUN_SETTINGS.get((row["source"], row["model"]), {})
    mbs = [int(row["micro_batch"])] if row["micro_batch"] else [b for b in (1, 2, 4, 8, 16) if per_dp % b == 0]
    mbs = [known["micro_batch"]] if "micro_batch" in known else mbs
    sched = row["schedule"]
    vs = [1]
    if sched == "interleaved-1f1b" and pp > 1:
        vs = [v for v in range(1, 9) if pp * v <= model.num_layers_total]
    vs = [known["virtual_stages"]] if "virtual_stages" in known else [int(row["vp"])] if row.get("vp") else vs
    how = {k: known[k] for k in ("overlap_grad_reduce", "overlap_param_gather", "lockstep", "p2p", "async_tp_allreduce",
                                 "grad_accumulation", "tp_comm_overlap")
           if k in known and framework}
    how.update(recv_buffers="in-flight", sent_outputs="freed")
    if row.get("tp_comm_overlap"):  # a column of its own (benchmarks/fp8_speedup.py's pairs)
        how["tp_comm_overlap"] = row["tp_comm_overlap"] == "true"
    src = source_settings(row["source"], row["arch"])
    how["elementwise_kernels"] = src["elementwise_kernels"] if framework else "eager"
    how["fsdp_copies"] = src["fsdp_copies"] if framework else True
    how["selective_recompute"] = src["selective_recompute"] if framework else "attention"
    how["defer_grad_sync"] = src["defer_grad_sync"] and framework
    if not src["master_weights"]:  # the weights themselves in bf16 (run_settings.py): what the run holds
        how.update(master_weights=False, adam_moments=src["adam_moments"])
    how.update(attention=src["attention"], dropout=src["dropout"], fp8=row.get("fp8") or None,
               fp8_param_gather=row.get("fp8_param_gather") == "true")
    recs = [row["recompute"]] if row["recompute"] else ["none", "selective", "full"]
    zeros = [int(row["zero"])] if row.get("zero") else src["zeros"]
    for b, v, rec, zero in itertools.product(mbs, vs, recs, zeros):
        if sched == "interleaved-1f1b" and pp > 1 and (per_dp // b) % pp:
            continue
        yield dict(micro_batch=b, virtual_stages=v, recompute=rec, zero=zero, tp=tp, pp=pp, dp=dp, cp=cp, ep=ep,
                   schedule=sched, global_batch=gbs, **how)


# a recompute cell naming torchtitan's "selective layer" checkpointing at its frequency 2 (ac_freq "2":
# torchtitan/parallelisms/parallelize_llama.py at 157a12c56 wraps a block where its count of blocks
# seen is even, so the 2nd, 4th, ... block is recomputed in full, the others not at all)
EVERY_SECOND = "full-every-2"


def every_second_block_full(plan):
    """The plan with its 2nd, 4th, ... block recomputed in full, the rest of its layers not (EVERY_SECOND)."""
    m = plan.model
    stages = [dataclasses.replace(st, recompute=["full" if m.layer_kind(i) == "block" and i % 2 == 0 else "none"
                                                 for i in range(st.start, st.end)]) for st in plan.pipeline.stages]
    return dataclasses.replace(plan, pipeline=dataclasses.replace(plan.pipeline, stages=stages)).validate()


def predict_row(row, framework: bool = True):
    model = row_model(row)
    gpus = int(row["gpus"])
    per_node = int(row.get("devices_per_node") or 8)  # the GPUs a node gives the run (an NVL72 rack: 64)
    cluster = load_cluster(row["cluster"], nodes=gpus // per_node)
    best = None
    for c in candidates(row, model, gpus, framework):
        try:
            dtype = RUN_SETTINGS.get((row["source"], row["model"]), {}).get("dtype") or row["dtype"]
            plan = build_plan(model, cluster_name=cluster.name, device=cluster.device.name, nodes=gpus // per_node,
                              devices_per_node=per_node, seq_len=int(row["seq_len"]), dtype=dtype,
                              sequence_parallel=row["sequence_parallel"] == "true",
                              **dict(c, recompute="none" if c["recompute"] == EVERY_SECOND else c["recompute"]))
            plan = every_second_block_full(plan) if c["recompute"] == EVERY_SECOND else plan
        except ConfigError:
            continue
        est = estimate(plan, cluster)
        # a fitting setting beats any that does not; the published run ran, so where none fits
        # the fastest is kept and flagged (the memory model over-predicts it)
        if best is None or (est.fits, -est.step_time_s) > (best[1].fits, -best[1].step_time_s):
            best = (c, est, plan)
    return model, best


def published_flops(row, model) -> float:
    """Model FLOPs per step as the paper counts them (recomputed forward included under full)."""
    rec = "full" if row["recompute"] == "full" else "none"
    return model.model_flops_per_step(int(row["global_batch"]), int(row["seq_len"]), recompute=rec)


def published_step_time(row, model) -> float:
    if row["published_step_time_s"]:
        return float(row["published_step_time_s"])
    return published_flops(row, model) / (float(row["published_tflops_per_gpu"]) * 1e12 * int(row["gpus"]))


def predict_rows(rows) -> list[dict]:
    out = []
    for row in rows:
        model, best = predict_row(row)
        pub = published_step_time(row, model)
        if best is None:
            out.append(dict(source=row["source"], model=row["model"], gpus=int(row["gpus"]), error=None,
                            note="no configuration fits"))
            continue
        c, est, plan = best
        err = (est.step_time_s - pub) / pub
        out.append(dict(source=row["source"], model=row["model"], gpus=int(row["gpus"]),
                        tp=c["tp"], pp=c["pp"], dp=c["dp"], cp=c["cp"], ep=c["ep"], micro_batch=c["micro_batch"], v=c["virtual_stages"],
                        recompute=c["recompute"], sp=row["sequence_parallel"] == "true", zero=c["zero"],
                        fp8=c["fp8"] or "",
                        published_step_s=pub, predicted_step_s=est.step_time_s,
                        published_tflops=(float(row["published_tflops_per_gpu"]) if row["published_tflops_per_gpu"]
                                          else published_flops(row, model) / pub / int(row["gpus"]) / 1e12),
                        predicted_tflops=published_flops(row, model) / est.step_time_s / int(row["gpus"]) / 1e12,
                        bubble=est.breakdown["bubble_fraction"], fits=est.fits, error=err))
    return out


def summary(out) -> tuple[float, float]:
    errs = [abs(r["error"]) for r in out if r["error"] is not None]
    return (sum(errs) / len(errs) if errs else float("nan")), (max(errs) if errs else float("nan"))


def show(out, title: str, targets: str):
    import pandas as pd
    df = pd.DataFrame(out)
    cols = [c for c in ("source", "model", "gpus", "tp", "pp", "dp", "cp", "ep", "micro_batch", "v", "recompute", "sp",
                        "zero", "fp8",
                        "published_step_s", "predicted_step_s", "published_tflops", "predicted_tflops",
                        "bubble", "fits", "error", "note") if c in df]
    print(title)
    with pd.option_context("display.width", 250, "display.max_columns", 30, "display.float_format", "{:.3f}".format):
        print(df[cols].to_string(index=False))
    mape, worst = summary(out)
    n = sum(r["error"] is not None for r in out)
    print(f"\nrows: {n}  MAPE: {mape:.1%}  worst: {worst:.1%}{targets}\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv", default=str(DEFAULT_CSV))
    ap.add_argument("--heldout", nargs="*", default=[str(p) for p in (HELDOUT_CSV, MOSAICML_CSV, TORCHTITAN_CSV, LLAMA3_CP_CSV, MOE_CSV,
                                                          NEMO_AUTOMODEL_CSV, FP8_CSV, DGXC_CSV, MEGATRON_CORE_CSV,
                                                          KEMPNERFORGE_CSV)],
                    help="runs reported apart, each file on its own (default: %(default)s)")
    ap.add_argument("--no-heldout", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    out = predict_rows(list(csv.DictReader(open(args.csv))))
    helds = {} if args.no_heldout else {f: predict_rows(list(csv.DictReader(open(f)))) for f in args.heldout}
    mape, worst = summary(out)
    if args.json:
        print(json.dumps({"rows": out, "mape": mape, "worst": worst,
                          "heldout": {f: dict(rows=h, mape=summary(h)[0], worst=summary(h)[1])
                                      for f, h in helds.items()}}, indent=2))
    else:
        show(out, f"== {args.csv}", "  (targets: MAPE <= 5%, worst <= 12%)")
        for f, held in helds.items():
            unfit = sum(r.get("fits") is False for r in held)
            show(held, f"== held out: {f}", "  (reported, no target)" +
                 (f"; {unfit} predicted not to fit, though they ran" if unfit else ""))
    ok = all(r["error"] is not None for r in out + [r for h in helds.values() for r in h])
    return 0 if (out and ok) else 1

if __name__ == "__main__":
    sys.exit(main())
