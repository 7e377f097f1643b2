"""One device of a cluster profile: peak and achieved rates, and the measured curves that refine them.

- `device.matmul_flops_by_size`: sustained GEMM FLOP/s at square sizes ([[edge, flop/s], ...]
  per dtype). A product M x K x N runs at the rate of the square GEMM of the same arithmetic
  intensity (FLOPs per element read or written: 2MNK / (MK + KN + MN), which for an n-cube is
  2n/3), edge 3MNK / (MK + KN + MN), interpolated in log(edge) and clamped to the measured range;
  dtypes without a curve run at peak x matmul_efficiency. Intensity, not FLOPs, sets what a
  product reaches (the roofline's premise, Williams et al. 2009): on the three non-square
  products of the source table the intensity edge misses by +1.3, +11 and -24% where the edge of
  equal FLOPs, (MNK)^(1/3), missed by +1.5, +17 and +52% (profiles/hardware/dgx-a100-80gb.json,
  sources).
- `device.attention_flops`: FLOP/s of fused (flash) attention per dtype, forward and backward
  together, as FlashAttention's benchmark counts them (4 s^2 d per head forward, 2.5x that
  backward). Fused attention is not a library GEMM: FlashAttention-2 reaches 50-73% of the dense
  peak (Dao 2023), below what cuBLAS sustains. Without it, fused attention runs at peak x
  matmul_efficiency.
- `device.attention_flops_by_seq`: the same rate measured with the causal mask, by kernel, head
  dimension and sequence length: {kernel: {head_dim: [[seq_len, flop/s], ...]}}, for the 16-bit
  dtypes FlashAttention runs (FLOPs halved for the mask, as its benchmark counts them). A
  kernel's rate climbs with the sequence (FlashAttention-2 on A100, head dimension 128: 99
  TFLOP/s at 512 tokens, 155 at 2k, 182 at 8k; Dao 2023, Fig. 4d), so one figure measured at 8k
  overstates it at 2k. Interpolated in log(seq_len), and linearly between the two nearest head
  dimensions; held at the end values outside the measured range. Where a profile has it, it
  replaces `attention_flops` for that kernel; a kernel other than `flash` needs it. The curve
  `masked` is torch's attention under a dense additive mask (runtime.documents: a document mask,
  all s^2 scores counted): where a profile has it, it rates plans with training.document_mask,
  else flash's curve does.
- `device.conversion_bandwidth_bytes_per_s`: bytes/s (read and written) of the eager elementwise
  kernels that convert dtypes on the way, by class: `upcast`, reading 16-bit values and writing
  float32 ones (a cast to float32, a float32 add of a 16-bit operand); `broadcast`, operands of
  mixed dtypes one of which is broadcast along rows (the loss's logits less their row maximum into
  float32). PyTorch's CUDA elementwise loops take a non-vectorized path where an operand needs a
  dtype conversion, so these run below the copy bandwidth: on one H200, 1.99 and 1.36 TB/s
  against a 3.94 TB/s copy (benchmarks/gpu_runs/h200-2026-11-30; its cast of float32 to bf16 ran
  at 3.85 TB/s, so casts down are priced as plain traffic). planner.pointwise says which bytes of
  a layer are which. Without the field they run at the memory bandwidth.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from planner.model import ATTENTION_KERNELS, ConfigError
from planner.profile_checks import check_keys, decimal

FUSED_ATTENTION_DTYPES = ("fp16", "bf16")  # what FlashAttention kernels run
MASKED_KERNEL = "masked"  # attention_flops_by_seq's curve under a dense mask (module doc)
DEVICE_KEYS = ("name", "memory_bytes", "peak_flops", "matmul_efficiency", "memory_bandwidth_bytes_per_s",
               "memory_bandwidth_efficiency", "reserved_bytes", "allocator_overhead_fraction",
               "matmul_flops_by_size", "attention_flops", "attention_flops_by_seq",
               "conversion_bandwidth_bytes_per_s")
CONVERSIONS = ("upcast", "broadcast")  # classes of dtype-converting elementwise kernels (module doc)


# what a profile's figures can be, by the key's ending: a byte rate from 1 kB/s to 1 EB/s, a
# latency under 1000 s, bytes under 1 EB (beyond these, times and sizes stop being figures)
RANGES = (("bytes_per_s", 1e3, 1e18), ("alpha_s", 0.0, 1e3), ("bytes", 0.0, 1e18))


def _num(d: dict, key: str, where: str, positive: bool = True) -> float:
    v = d.get(key)
    if (not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or (positive and v <= 0)
            or v < 0):
        raise ConfigError(f"{where}.{key}: {v!r} must be a finite {'positive' if positive else 'non-negative'} number")
    for end, low, high in RANGES:
        if key.endswith(end):
            if not low <= v <= high:
                raise ConfigError(f"{where}.{key}: {v!r} must be from {low:g} to {high:g}; check the profile")
            break
    return float(v)


def _curve(points, where: str, x: str, y: str) -> tuple:
    """A measured curve [[x, y], ...]: at least two points, positive, x strictly ascending."""
    ok = isinstance(points, list) and len(points) >= 2 and all(
        isinstance(p, list) and len(p) == 2 and all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
                                                     and math.isfinite(v) for v in p) for p in points)
    if not ok:
        raise ConfigError(f"{where}: expected a list of at least two [{x}, {y}] pairs of positive numbers")
    if any(b[0] <= a[0] for a, b in zip(points, points[1:])):
        raise ConfigError(f"{where}: the {x} values must rise strictly from one point to the next")
    return tuple((float(a), float(b)) for a, b in points)


def _interp(curve: tuple, x: float, log_y: bool) -> float:
    """y at x on measured (x, y) points, ascending in x: interpolated in log(x) (and in log(y)
    with `log_y`), held at the end values outside the measured range."""
    if x <= curve[0][0]:
        return curve[0][1]
    for (x1, y1), (x2, y2) in zip(curve, curve[1:]):
        if x <= x2:
            f = math.log(x / x1) / math.log(x2 / x1)
            return math.exp(math.log(y1) + f * math.log(y2 / y1)) if log_y else y1 + f * (y2 - y1)
    return curve[-1][1]


class PerDtype(dict):
    """dtype -> rate; a dtype the profile does not give is a ConfigError at the point of use."""

    def need(self, dtype: str) -> None:
        if dtype not in self:
            self.__missing__(dtype)

    def __missing__(self, dtype):
        raise ConfigError(f"device.peak_flops: no entry for {dtype} (the cluster profile has {', '.join(self)}); "
                          f"add one to the profile or plan with --dtype {next(iter(self), dtype)}")


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    memory_bytes: int
    peak_flops: dict
    matmul_efficiency: dict
    memory_bandwidth_bytes_per_s: float
    memory_bandwidth_efficiency: float
    reserved_bytes: int = 0  # held outside the allocator: runtime context, communicator buffers
    allocator_overhead_fraction: float = 0.0  # caching-allocator fragmentation, as a fraction of what it hands out
    matmul_by_size: dict = field(default_factory=dict)  # dtype -> ((edge, flop/s), ...) measured, ascending
    attention_flops: dict = field(default_factory=dict)  # dtype -> fused attention FLOP/s, measured
    attention_by_seq: dict = field(default_factory=dict)  # kernel -> ((head_dim, curve), ...), causal
    conversion_bandwidth: dict = field(default_factory=dict)  # class -> bytes/s, measured (module doc)

    def __post_init__(self):
        for f in ("peak_flops", "matmul_efficiency"):
            if not isinstance(getattr(self, f), PerDtype):
                object.__setattr__(self, f, PerDtype(getattr(self, f)))

    def matmul_flops_per_s(self, dtype: str) -> float:
        return self.peak_flops[dtype] * self.matmul_efficiency[dtype]

    def attention_flops_per_s(self, dtype: str, seq_len: float | None = None, head_dim: float | None = None,
                              kernel: str = "flash") -> float:
        """Achieved FLOP/s of fused attention with the causal mask, forward and backward together:
        the measured curve of `kernel` at (seq_len, head_dim) where the profile has one (module
        doc), else `attention_flops`, else matmul_flops_per_s."""
        self.peak_flops.need(dtype)
        curves = self.attention_by_seq.get(kernel)
        if curves and dtype in FUSED_ATTENTION_DTYPES and seq_len is not None and head_dim is not None:
            return _between_head_dims(curves, float(seq_len), float(head_dim))
        if kernel != "flash":
            raise ConfigError(f"training.attention: the cluster profile has no attention_flops_by_seq.{kernel} "
                              f"for {dtype}; use flash, or a profile that measured {kernel}")
        return self.attention_flops.get(dtype) or self.matmul_flops_per_s(dtype)

    def attention_kernel(self, t) -> str:
        """The attention_flops_by_seq curve that rates training `t`'s attention: its kernel, or
        under a document mask the masked curve where the profile measured one."""
        return MASKED_KERNEL if t.document_mask and t.attention == "flash" and MASKED_KERNEL in self.attention_by_seq \
            else t.attention

    def gemm_flops_per_s(self, dtype: str, M: float, N: float, K: float) -> float:
        """Achieved FLOP/s of an M x K by K x N product: the measured curve at the edge of the
        square product of equal arithmetic intensity, 3MNK / (MK + KN + MN), where the profile
        has one for `dtype` (module doc), else matmul_flops_per_s."""
        curve = self.matmul_by_size.get(dtype)  # only for dtypes of peak_flops (_matmul_curves)
        if not curve:
            return self.matmul_flops_per_s(dtype)
        M, N, K = float(M), float(N), float(K)
        edge = 3.0 * M * N * K / (M * K + K * N + M * N)
        return _interp(curve, edge, log_y=False)

    @property
    def memory_bytes_per_s(self) -> float:
        return self.memory_bandwidth_bytes_per_s * self.memory_bandwidth_efficiency

    def pointwise_seconds(self, total: float, upcast: float = 0.0, broadcast: float = 0.0) -> float:
        """Seconds of memory-bound kernels moving `total` bytes, of which `upcast` and `broadcast`
        bytes in dtype-converting kernels of those classes (module doc)."""
        conv = self.conversion_bandwidth
        bw = self.memory_bytes_per_s
        return ((total - upcast - broadcast) / bw + upcast / conv.get("upcast", bw)
                + broadcast / conv.get("broadcast", bw))


def _between_head_dims(curves: tuple, seq_len: float, head_dim: float) -> float:
    """The rate at seq_len, linear between the two measured head dimensions around head_dim."""
    if head_dim <= curves[0][0]:
        return _interp(curves[0][1], seq_len, log_y=False)
    for (d1, c1), (d2, c2) in zip(curves, curves[1:]):
        if head_dim <= d2:
            r1, r2 = _interp(c1, seq_len, log_y=False), _interp(c2, seq_len, log_y=False)
            return r1 + (head_dim - d1) / (d2 - d1) * (r2 - r1)
    return _interp(curves[-1][1], seq_len, log_y=False)


def _matmul_curves(d, peak: dict, where: str) -> dict:
    if d is None:
        return {}
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: expected an object of dtype -> [[edge, flop/s], ...]")
    out = {}
    for k, points in d.items():
        if k not in peak:
            raise ConfigError(f"{where}.{k}: no peak_flops for this dtype; use one of {', '.join(peak)}")
        out[k] = _curve(points, f"{where}.{k}", "edge", "flop/s")
        if any(r > peak[k] for _, r in out[k]):
            raise ConfigError(f"{where}.{k}: a rate above peak_flops.{k}; give achieved FLOP/s")
    return out


def _rates(d, peak: dict, where: str) -> dict:
    if d is None:
        return {}
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: expected an object of dtype -> FLOP/s")
    for k in d:
        if k not in peak:
            raise ConfigError(f"{where}.{k}: no peak_flops for this dtype; use one of {', '.join(peak)}")
        if _num(d, k, where) > peak[k]:
            raise ConfigError(f"{where}.{k}: above peak_flops.{k}; give achieved FLOP/s")
    return {k: float(v) for k, v in d.items()}


def _attention_curves(d, peak: dict, where: str) -> dict:
    """{kernel: {head_dim: [[seq_len, flop/s], ...]}} -> {kernel: ((head_dim, curve), ...)}."""
    if d is None:
        return {}
    if not isinstance(d, dict) or not all(isinstance(v, dict) and v for v in d.values()):
        raise ConfigError(f"{where}: expected an object of kernel -> {{head_dim: [[seq_len, flop/s], ...]}}")
    top = max((peak.get(k, 0.0) for k in FUSED_ATTENTION_DTYPES), default=0.0)
    out = {}
    fused = tuple(k for k in ATTENTION_KERNELS if k != "unfused") + (MASKED_KERNEL,)
    for kernel, by_dim in d.items():
        if kernel not in fused:
            raise ConfigError(f"{where}.{kernel}: unknown kernel; rated kernels are {', '.join(fused)}")
        dims = []
        for hd, points in by_dim.items():
            w = f"{where}.{kernel}.{hd}"
            if not decimal(hd) or int(hd) < 1:
                raise ConfigError(f"{w}: the key must be a head dimension (a positive integer)")
            curve = _curve(points, w, "seq_len", "flop/s")
            if not top or any(r > top for _, r in curve):
                raise ConfigError(f"{w}: a rate above the 16-bit peak_flops; give achieved FLOP/s")
            dims.append((float(hd), curve))
        out[kernel] = tuple(sorted(dims))
    return out


def device_from_dict(dv, w: str) -> DeviceSpec:
    """Parse and check a profile's `device` object; errors name the field."""
    if not isinstance(dv, dict):
        raise ConfigError(f"{w}: expected an object")
    check_keys(dv, DEVICE_KEYS, f"{w}.")
    if not isinstance(dv.get("name", ""), str):
        raise ConfigError(f"{w}.name: {dv['name']!r} must be a string")
    peak, eff = dv.get("peak_flops"), dv.get("matmul_efficiency")
    if not isinstance(peak, dict) or not peak:
        raise ConfigError(f"{w}.peak_flops: expected an object of dtype -> FLOP/s")
    if not isinstance(eff, dict) or set(eff) != set(peak):
        raise ConfigError(f"{w}.matmul_efficiency: must give one efficiency per dtype of peak_flops ({', '.join(peak)})")
    for k in peak:
        _num(peak, k, f"{w}.peak_flops")
        e = _num(eff, k, f"{w}.matmul_efficiency")
        if e > 1:
            raise ConfigError(f"{w}.matmul_efficiency.{k}: {e} is above 1; it is achieved / peak")
    if _num(dv, "memory_bandwidth_efficiency", w) > 1:
        raise ConfigError(f"{w}.memory_bandwidth_efficiency: {dv['memory_bandwidth_efficiency']} is above 1; "
                          "it is achieved / peak bandwidth, in (0, 1]")
    if "allocator_overhead_fraction" in dv and _num(dv, "allocator_overhead_fraction", w, positive=False) >= 1:
        raise ConfigError(f"{w}.allocator_overhead_fraction: {dv['allocator_overhead_fraction']} must be below 1; "
                          "it is the share of the memory lost to fragmentation, in [0, 1)")
    if "reserved_bytes" in dv and _num(dv, "reserved_bytes", w, positive=False) >= _num(dv, "memory_bytes", w):
        raise ConfigError(f"{w}.reserved_bytes: {dv['reserved_bytes']!r} must be below memory_bytes "
                          f"({dv['memory_bytes']!r}); it is the part of the memory held outside the allocator")
    return DeviceSpec(
        name=dv.get("name", "unknown"),
        memory_bytes=int(_num(dv, "memory_bytes", w)),
        peak_flops={k: float(v) for k, v in peak.items()},
        matmul_efficiency={k: float(v) for k, v in eff.items()},
        memory_bandwidth_bytes_per_s=_num(dv, "memory_bandwidth_bytes_per_s", w),
        memory_bandwidth_efficiency=_num(dv, "memory_bandwidth_efficiency", w),
        reserved_bytes=int(_num(dv, "reserved_bytes", w, positive=False)) if "reserved_bytes" in dv else 0,
        allocator_overhead_fraction=(_num(dv, "allocator_overhead_fraction", w, positive=False)
                                     if "allocator_overhead_fraction" in dv else 0.0),
        matmul_by_size=_matmul_curves(dv.get("matmul_flops_by_size"), peak, f"{w}.matmul_flops_by_size"),
        attention_flops=_rates(dv.get("attention_flops"), peak, f"{w}.attention_flops"),
        attention_by_seq=_attention_curves(dv.get("attention_flops_by_seq"), peak, f"{w}.attention_flops_by_seq"),
        conversion_bandwidth=_conversions(dv.get("conversion_bandwidth_bytes_per_s"),
                                          f"{w}.conversion_bandwidth_bytes_per_s"),
    )


def _conversions(d, where: str) -> dict:
    if d is None:
        return {}
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: expected an object of {' / '.join(CONVERSIONS)} -> bytes/s")
    for k in d:
        if k not in CONVERSIONS:
            raise ConfigError(f"{where}.{k}: unknown class; use {' or '.join(CONVERSIONS)}")
    return {k: _num(d, k, where) for k in d}
