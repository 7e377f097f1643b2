"""The device part of `trident profile cluster` on GPUs (runtime.profile times the collectives).

Every rank measures its own GPU at once, in the dtypes the runtime trains in:
- matmul_flops_by_size: sustained FLOP/s of square products per dtype (bf16, fp16, fp32), each
  the best batch of products between two synchronizations (a batch lasts at least a millisecond,
  so that launch and synchronization costs vanish); peak_flops is the best of them (a profile
  measured here knows no datasheet: MFU is then against the best rate measured), and
  matmul_efficiency the median rate at transformer-like shapes over it;
- attention_flops_by_seq.flash: torch's scaled_dot_product_attention with the causal mask,
  forward and backward, in bf16 (FlashAttention-2 on recent GPUs, what the runtime runs), at head
  dimensions 64 and 128 and sequence lengths 512 to 16k, set up as the FlashAttention-2 benchmark
  (Dao 2023, Fig. 4: 16k tokens a batch, hidden 2048) and counted as it counts (4 s^2 d per head
  forward, halved for the mask, 2.5x that backward); attention_flops_by_seq.masked the same under
  a dense additive mask of the runtime's document masks (runtime.documents; documents of a quarter
  sequence), all s^2 scores counted, which rates plans with training.document_mask;
- memory bandwidth: a 1 GiB copy (larger than any GPU's L2), reads and writes counted; that of
  the kernels converting dtypes (conversion_bandwidth: a cast of bf16 to float32, and the loss's
  broadcast subtraction into float32), which PyTorch runs unvectorized;
- memory: the device's total memory; reserved_bytes, what the device holds outside PyTorch's
  caching allocator (its context, NCCL's buffers), is read after the collectives ran
  (runtime.profile.reserved_outside_allocator);
- overlap_slowdown: products timed by CUDA events on the compute stream while a 256 MiB NCCL
  all-reduce runs, over the same alone;
- compute_slots: the world size (each rank has its own GPU).
"""
from __future__ import annotations

import math
import statistics

import torch
import torch.distributed as dist

from runtime.comm_sweep import mean_over_ranks, overlap_ratio
from runtime.device import current, scalar, timed

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
EDGES = (1024, 2048, 4096, 8192, 16384)
SHAPES = ((8192, 4096, 4096), (8192, 11008, 4096), (8192, 4096, 11008), (8192, 8192, 8192), (16384, 1024, 8192))
ATTN_DIMS, ATTN_SEQS = (64, 128), (512, 1024, 2048, 4096, 8192, 16384)


def _batched_rate(fn, flops: float, budget_s: float) -> float:
    """Best FLOP/s of `fn` over batches of calls, each batch at least 1 ms between synchronizations."""
    fn()
    reps = max(1, math.ceil(1e-3 / max(timed(fn), 1e-7)))

    def batch():
        for _ in range(reps):
            fn()
    best, spent = 0.0, 0.0
    while spent < budget_s or best == 0.0:
        dt = timed(batch)
        spent += dt
        best = max(best, reps * flops / dt)
    return best


def matmul_rate(m: int, n: int, k: int, dtype, budget_s: float) -> float:
    dev = current()
    a, b = torch.randn(m, k, device=dev, dtype=dtype), torch.randn(k, n, device=dev, dtype=dtype)
    return _batched_rate(lambda: a @ b, 2.0 * m * n * k, budget_s)


def attention_rate(seq: int, head_dim: int, budget_s: float, tokens: int = 16384, hidden: int = 2048,
                   masked: bool = False) -> float:
    import torch.nn.functional as F

    from runtime.documents import DocumentMask
    dev, heads, batch = current(), hidden // head_dim, max(1, tokens // seq)
    q, k, v = (torch.randn(batch, heads, seq, head_dim, device=dev, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    grad = torch.randn(batch, heads, seq, head_dim, device=dev, dtype=torch.bfloat16)
    docs = (torch.arange(seq, device=dev) // max(1, seq // 4)).expand(batch, -1)  # four documents a row
    mask = DocumentMask(docs)(torch.bfloat16) if masked else None

    def fwd_bwd():
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=not masked).backward(grad)
    return _batched_rate(fwd_bwd, 3.5 * 4 * batch * heads * seq * seq * head_dim / (1 if masked else 2), budget_s)


def memory_bandwidth() -> float:
    src = torch.randn(256 * 2**20, device=current())
    dst = torch.empty_like(src)
    dst.copy_(src)
    return 2 * src.numel() * 4 / min(timed(lambda: dst.copy_(src)) for _ in range(10))


def conversion_bandwidth(n: int = 2**28, repeats: int = 10) -> dict:
    """Bytes/s (read and written) of the dtype-converting eager kernels that planner.device prices
    apart (conversion_bandwidth_bytes_per_s), on n elements, best of `repeats`: `upcast`, a bf16
    tensor cast to float32 (2 + 4 bytes an element); `broadcast`, bf16 rows less a float32 value per
    row written to float32 (runtime/loss.py's subtraction of the row maximum). On CPU or GPU."""
    dev = current()
    a16 = torch.randn(n, device=dev, dtype=torch.bfloat16)
    rows = a16.view(-1, 8192)
    top = torch.randn(rows.shape[0], 1, device=dev)
    out32 = torch.empty(rows.shape, device=dev)
    cases = {"upcast": lambda: a16.float(), "broadcast": lambda: torch.sub(rows, top, out=out32)}
    out = {}
    for name, fn in cases.items():
        fn()
        out[name] = 6 * n / min(timed(fn) for _ in range(repeats))
    return out


def _stream_time(fn) -> float:
    """Seconds of `fn`'s work on the current stream, by CUDA events (work on other streams, such as
    NCCL's, is not waited for)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def overlap_slowdown() -> float:
    a = torch.randn(4096, 4096, device=current(), dtype=torch.bfloat16)

    def work():
        for _ in range(20):
            a @ a
    work()
    ratio = overlap_ratio(work, _stream_time, torch.ones(64 * 2**20, device=current()))
    torch.cuda.synchronize()
    return ratio


def measure_device(quick: bool) -> tuple[dict, dict, float, float]:
    """(device object, its sources, overlap_slowdown, compute_slots) of this rank's GPU, averaged over ranks."""
    dev = current()
    budget = 0.03 if quick else 0.15
    curves, peak, eff = {}, {}, {}
    for name, dt in DTYPES.items():
        curves[name] = [[e, mean_over_ranks(matmul_rate(e, e, e, dt, budget))] for e in EDGES]
        peak[name] = max(r for _, r in curves[name])
        shapes = [mean_over_ranks(matmul_rate(m, n, k, dt, budget / 3)) for m, n, k in SHAPES]
        eff[name] = min(1.0, statistics.median(shapes) / peak[name])
    top16 = max(peak["bf16"], peak["fp16"])
    attn = {kernel: {str(d): [[s, min(top16, mean_over_ranks(attention_rate(s, d, budget, masked=kernel == "masked")))]
                              for s in ATTN_SEQS] for d in ATTN_DIMS} for kernel in ("flash", "masked")}
    props = torch.cuda.get_device_properties(dev)
    device = {
        "name": torch.cuda.get_device_name(dev),
        "memory_bytes": int(props.total_memory),
        "peak_flops": peak,
        "matmul_efficiency": eff,
        "memory_bandwidth_bytes_per_s": mean_over_ranks(memory_bandwidth()),
        "memory_bandwidth_efficiency": 1.0,
        "conversion_bandwidth_bytes_per_s": {k: mean_over_ranks(v) for k, v in conversion_bandwidth().items()},
        "reserved_bytes": 0,  # replaced after the collectives by reserved_outside_allocator
        "allocator_overhead_fraction": 0.05,
        "matmul_flops_by_size": curves,
        "attention_flops_by_seq": attn,
    }
    sources = {
        "device.peak_flops": "measured: the best rate of the square products of matmul_flops_by_size per dtype "
                             "(no datasheet peak is known to a measured profile: MFU is against this rate)",
        "device.matmul_flops_by_size": f"measured: torch.matmul of square products of edge {', '.join(map(str, EDGES))} "
                                       "per dtype (fp32 without TF32, torch's default), the best batch of products "
                                       "between two synchronizations (each batch at least 1 ms), mean over ranks",
        "device.matmul_efficiency": f"measured: median rate at the shapes {list(SHAPES)} over peak_flops",
        "device.attention_flops_by_seq": "measured: torch scaled_dot_product_attention (is_causal) forward + backward "
                                         f"in bf16, head dimensions {ATTN_DIMS}, sequence lengths {ATTN_SEQS}, 16k "
                                         "tokens a batch and hidden 2048 (the FlashAttention-2 benchmark's setup, Dao "
                                         "2023 Fig. 4), FLOPs counted as it counts them (4 s^2 d per head forward, "
                                         "halved for the mask, 2.5x backward); used for fp16 too; masked: the same "
                                         "under a dense additive mask of four documents a row (runtime.documents), "
                                         "all s^2 scores counted",
        "device.memory_bandwidth_bytes_per_s": "measured: best of 10 copies of a 1 GiB fp32 tensor (reads and writes "
                                               "counted), mean over ranks; efficiency 1: this is the achieved rate",
        "device.conversion_bandwidth_bytes_per_s": "measured: best of 10 of a 2^28-element bf16 tensor cast to "
                                                   "float32 (upcast) and of its rows of 8192 less a float32 per-row "
                                                   "value into float32 (broadcast), 6 bytes an element, mean over ranks",
        "device.memory_bytes": "measured: torch.cuda.get_device_properties().total_memory",
        "device.reserved_bytes": "measured: device memory in use (torch.cuda.mem_get_info) less what PyTorch's "
                                 "caching allocator reserves, after the collectives ran (CUDA context, NCCL "
                                 "buffers), the most over ranks",
        "device.allocator_overhead_fraction": "assumption, as in the shipped GPU profiles: 5% of allocated bytes lost "
                                              "to caching-allocator fragmentation and block rounding",
        "overlap_slowdown": "measured: 20 bf16 products of 4096^3 timed by CUDA events on the compute stream with and "
                            "without a 256 MiB NCCL all-reduce in flight, median of 5, mean over ranks",
        "compute_slots": "the world size: each rank computes on its own GPU",
    }
    return device, sources, overlap_slowdown(), float(dist.get_world_size())


def reserved_outside_allocator() -> int:
    """Bytes the device holds beyond PyTorch's caching allocator, the most over ranks."""
    dev = current()
    torch.cuda.synchronize(dev)
    free, total = torch.cuda.mem_get_info(dev)
    t = scalar(float(max(0, total - free - torch.cuda.memory_reserved(dev))))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t)
