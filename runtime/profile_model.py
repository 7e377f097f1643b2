"""`runtime.profile model`: per-layer forward, backward (with recomputation) and optimizer time, and
parameter, gradient and activation bytes of a model, measured with the runtime's own modules
(runtime.model) under the runtime's own tensor parallelism (runtime.parallelize.apply_tp on a
tp sub-mesh) and recomputation (apply_recompute). The JSON format is planner/model_profile.py's.

Every rank measures at once (the world is split into groups of `tp` ranks), so the times are
those of a device while all N processes of the launch are busy, as in a training run on N. Each
rank measures the device runtime.train would train on (runtime.device: its GPU, else the CPU), in
the dtype it would compute in (--dtype; bf16 is autocast over float32 weights, as the runtime
runs it), and times GPU work between synchronizations.
Activation bytes are the bytes of tensors a layer's forward creates and keeps alive (saved for
backward, and its output, which is the next layer's input): the memory the forward allocates and
has not freed when it returns, counted on CPU by runtime.metrics.cpu_counter, the counter
run.json's peak memory uses (views of the parameters allocate nothing and count nothing). The C
heap that counter reads also holds what gloo's worker threads have in flight when a TP layer's
forward returns, so each point is the median of several forwards.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from planner.model import ConfigError
from planner.model_files import load_model
from planner.model_profile import FORMAT_VERSION, fit_linear
from runtime.device import current, sync
from runtime.profile_optimizer import MIN_SAMPLE_S, passes_per_sample, time_optimizer

AMP_DTYPES = {"bf16": torch.bfloat16}  # computed under autocast over float32 weights, as runtime.train does


def _ints(text: str, flag: str) -> list[int]:
    try:
        vals = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{flag}: {text!r} must be a comma-separated list of positive integers") from None
    if not vals or any(v < 1 for v in vals):
        raise ConfigError(f"{flag}: {text!r} must be a comma-separated list of positive integers")
    return sorted(set(vals))


def check_args(args, world: int) -> None:
    """Validate before the process group starts; ConfigError with one line otherwise."""
    from planner.cluster import load_cluster
    model = load_model(args.model)
    args.model_config = dataclasses.replace(model, tie_embeddings=False) if model.tie_embeddings else model
    args.mbs = _ints(args.micro_batches, "--micro-batches")
    args.tps = _ints(args.tp, "--tp")
    if args.seq_len < 1 or args.seq_len > model.seq_len:
        raise ConfigError(f"--seq-len: {args.seq_len} must be between 1 and the model's seq_len {model.seq_len}")
    for tp in args.tps:
        if world % tp:
            raise ConfigError(f"--tp: {tp} does not divide the {world} processes launched")
        for fld, n in model.tp_split_sizes():  # the vocabulary may split unevenly (as DTensor splits)
            if n % tp:
                raise ConfigError(f"--tp: {tp} does not divide model.{fld}={n}")
        if tp > 1 and args.seq_len % tp:
            raise ConfigError(f"--seq-len: {args.seq_len} is not divisible by tp={tp} (sequence parallelism)")
    args.cps = sorted({1, *_ints(args.cp, "--cp")})  # every layer is measured without it too
    for cp in args.cps:
        if world % cp or (cp > 1 and args.seq_len % (2 * cp)):  # CP splits a sequence into 2 x cp chunks
            raise ConfigError(f"--cp: {cp} must divide the {world} processes launched and its double the "
                              f"sequence ({args.seq_len} tokens)")
    if args.repeats < 3:
        raise ConfigError(f"--repeats: {args.repeats}; use at least 3")
    # the runtime computes in the plan's dtype on a GPU and in float32 on the CPU unless told
    args.dtype = args.dtype or ("bf16" if torch.cuda.is_available() else "fp32")
    if args.dtype not in ("fp32", "bf16"):
        raise ConfigError(f"--dtype: {args.dtype!r}; the runtime computes in fp32 or bf16")
    args.cluster = load_cluster(args.cluster_profile, flag="--cluster-profile")


def _bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor
    total = 0
    for t in tensors:
        if t is None:
            continue
        t = t._local_tensor if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    return total


def _build(cfg, kind: str, tp_mesh, sp: bool, rec: str, dp_mesh=None, zero: int = 0, dtype: str = "fp32"):
    from runtime.model import Transformer, init_weights
    from runtime.parallelize import apply_data_parallel, apply_recompute, apply_tp
    index = {"embedding": 0, "block": 1, "head": cfg.layers + 1}[kind]
    with torch.device("meta"):
        chunk = Transformer(cfg, index, index + 1)
    if tp_mesh.size() > 1:
        apply_tp(chunk, tp_mesh, sp)
    apply_recompute(chunk, {index: rec})
    if dp_mesh is not None:
        apply_data_parallel(chunk, dp_mesh, zero, AMP_DTYPES.get(dtype))
    chunk.to_empty(device=current())
    init_weights(chunk, 0)
    return chunk


def _inputs(cfg, kind: str, mb: int, s: int, tp: int, tp_rank: int, sp: bool, context=None):
    """The layer's input, the same on every rank of a TP group (sequence-sharded under SP; under
    context parallelism the rank's tokens)."""
    g = torch.Generator().manual_seed(1000 + mb)
    ids = torch.randint(0, cfg.vocab, (mb, s), generator=g).to(current())
    if kind == "embedding":
        return ids, None
    x = torch.randn(mb, s, cfg.hidden, generator=g).to(current())
    if context is not None:
        x, ids = context.local_tokens(x), context.local_tokens(ids)
    if sp and tp > 1:
        x = x.chunk(tp, dim=1)[tp_rank].contiguous()
    return x.requires_grad_(True), ids


def _counter_name() -> str:
    from runtime.metrics import memory_counter
    return memory_counter(current())[1]


def _loss_fn(tp_mesh, vocab: int):
    """The runtime's loss on this rank's vocabulary slice (runtime.loss)."""
    from runtime.loss import cross_entropy
    group = tp_mesh.get_group() if tp_mesh.size() > 1 else None
    return lambda out, targets: cross_entropy(out, targets, group, tp_mesh.get_local_rank(), vocab)


def _amp(dtype: str):
    """The runtime's autocast for `dtype` (runtime.train.Trainer._autocast), or none."""
    if dtype not in AMP_DTYPES:
        return contextlib.nullcontext()
    return torch.autocast(current().type, dtype=AMP_DTYPES[dtype], cache_enabled=False)


def _time_passes(chunk, kind, x, targets, loss, repeats, grad_sync=None, zero=0, dtype="fp32"):
    """Median forward and backward seconds per pass over `repeats` samples, each of k passes back
    to back (after two warm-up passes). `grad_sync` (FSDP modules only): whether gradients are
    synchronized, as the runtime's last micro-batch does (ZeRO 1/2 keep the parameters gathered
    between the micro-batches before it, as the runtime does)."""
    from torch.distributed.fsdp import FSDPModule
    if grad_sync is not None and isinstance(chunk, FSDPModule):
        chunk.set_requires_gradient_sync(grad_sync)
        if zero in (1, 2):
            chunk.set_reshard_after_backward(grad_sync)

    def one():
        if x.grad is not None:
            x.grad = None
        sync()
        t0 = time.perf_counter()
        with _amp(dtype):
            out = chunk(x)
            if kind == "head":
                out = loss(out, targets)
        sync()
        t1 = time.perf_counter()
        out.backward(torch.ones_like(out) if kind != "head" else None)
        sync()
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1

    one()
    k = passes_per_sample(sum(one()))
    fwd, bwd = [], []
    for _ in range(repeats):
        dist.barrier()
        f = b = 0.0
        for _ in range(k):
            df, db = one()
            f, b = f + df, b + db
        fwd.append(f / k)
        bwd.append(b / k)
    return statistics.median(fwd), statistics.median(bwd)


def measure_data_parallel(cfg, kind, mesh2d, sp, s, mb, repeats, plain, dtype="fp32") -> dict:
    """Extra forward / backward time per micro-batch, the extra of the gradient-synchronizing
    backward, and the optimizer step, of the layer wrapped as the runtime wraps it for ZeRO 0
    (replicate), 1-2 and 3 (FSDP2) on the dp sub-mesh, over the unwrapped layer's `plain` times."""
    tp_mesh, dp_mesh = mesh2d["tp"], mesh2d["dp"]
    tp = tp_mesh.size()
    loss = _loss_fn(tp_mesh, cfg.vocab)
    out = {"dp": dp_mesh.size(), "micro_batch": mb}
    for zero in (0, 1, 3):
        chunk = _build(cfg, kind, tp_mesh, sp, "none", dp_mesh, zero, dtype)
        x, targets = _inputs(cfg, kind, mb, s, tp, tp_mesh.get_local_rank(), sp)
        f, b_nosync = _time_passes(chunk, kind, x, targets, loss, repeats, grad_sync=False, zero=zero, dtype=dtype)
        f2, b_sync = _time_passes(chunk, kind, x, targets, loss, repeats, grad_sync=True, zero=zero, dtype=dtype)
        opt = time_optimizer(list(chunk.parameters()), repeats)
        vals = torch.tensor([min(f, f2), b_nosync, b_sync, opt], dtype=torch.float64, device=current())
        dist.all_reduce(vals, op=dist.ReduceOp.MAX)
        f, b_nosync, b_sync, opt = (float(v) for v in vals)
        out[f"zero{zero}"] = {"forward_s": max(0.0, f - plain[0]), "backward_s": max(0.0, b_nosync - plain[1]),
                              "backward_sync_s": max(0.0, b_sync - b_nosync), "optimizer_s": opt}
    return out


def measure(cfg, kind: str, mesh2d, sp: bool, rec: str, mbs: list[int], s: int, repeats: int,
            dtype: str = "fp32", optimizer_s: float | None = None) -> dict:
    """One entry of the profile; `optimizer_s`: the same parameters' optimizer step, measured
    already (recomputation does not change it)."""
    from runtime.metrics import LiveTensorBytes, memory_counter
    tp_mesh = mesh2d["tp"]
    tp = tp_mesh.size()
    chunk = _build(cfg, kind, tp_mesh, sp, rec, dtype=dtype)
    cp, context = 1, None
    if "cp" in mesh2d.mesh_dim_names:  # a block under context parallelism (runtime.context_parallel)
        from runtime.context_parallel import ContextParallel, apply_context_parallel
        cp = mesh2d["cp"].size()
        context = ContextParallel(mesh2d["cp"].get_group(), cp, mesh2d["cp"].get_local_rank(), s, current())
        apply_context_parallel(chunk, context)
    params = list(chunk.parameters())
    loss = _loss_fn(tp_mesh, cfg.vocab)
    points = []
    for mb in mbs:
        x, targets = _inputs(cfg, kind, mb, s, tp, tp_mesh.get_local_rank(), sp, context)

        def forward():
            with _amp(dtype):
                out = chunk(x)
                if kind == "head":
                    out = loss(out, targets)
            return out
        f, b = _time_passes(chunk, kind, x, targets, loss, repeats, dtype=dtype)
        acts = []
        gc.collect()  # garbage of earlier passes is not freed inside a window: none is left, and
        gc.disable()  # no collection runs until the windows are done
        try:
            for _ in range(repeats):  # the heap also holds what gloo's threads have in flight: a median
                dist.barrier()
                counter, _ = memory_counter(current())
                if isinstance(counter, LiveTensorBytes):  # a storage count: the input and the parameters are not the layer's
                    for t in [x, *params]:
                        counter.track(t)
                base = counter.current_bytes if isinstance(counter, LiveTensorBytes) else 0  # the others count from entry
                with counter:
                    out = forward()
                    acts.append(counter.current_bytes - base)
                out.backward(torch.ones_like(out) if kind != "head" else None)
                del out
        finally:
            gc.enable()
        points.append([mb, f, b, statistics.median(acts)])
    grad_bytes = _bytes(p.grad for p in params)
    opt_s = time_optimizer(params, repeats) if optimizer_s is None else optimizer_s
    # the slowest rank sets the pace: max over ranks of every measured time
    vals = torch.tensor([v for p in points for v in p[1:3]] + [opt_s], dtype=torch.float64, device=current())
    dist.all_reduce(vals, op=dist.ReduceOp.MAX)
    for i, p in enumerate(points):
        p[1], p[2] = float(vals[2 * i]), float(vals[2 * i + 1])
    xs = [p[0] for p in points]
    dp = {}
    if mesh2d["dp"].size() > 1 and rec == "none" and cp == 1:
        dp = {"data_parallel": measure_data_parallel(cfg, kind, mesh2d, sp, s, mbs[0], repeats, points[0][1:3],
                                                     dtype)}
    return {
        "layer": kind, "tp": tp, "sequence_parallel": sp, "recompute": rec, **({"cp": cp} if cp > 1 else {}),
        "forward_s": list(fit_linear(xs, [p[1] for p in points])),
        "backward_s": list(fit_linear(xs, [p[2] for p in points])),
        "activation_bytes": list(fit_linear(xs, [p[3] for p in points])),
        "optimizer_s": float(vals[-1]),
        "param_bytes": _bytes(params), "grad_bytes": grad_bytes,
        "points": points, **dp,
    }


def profile_model(args) -> dict | None:
    cfg, world, rank = args.model_config, dist.get_world_size(), dist.get_rank()
    configs = []
    for tp in args.tps:
        for sp in ([False] if tp == 1 else [False, True]):
            configs += [("embedding", tp, sp, "none", 1), ("head", tp, sp, "none", 1)]
            for cp in args.cps:  # the block also under each context-parallel degree that fits with tp
                if world % (tp * cp) == 0 and (not sp or args.seq_len // cp % tp == 0):
                    configs += [("block", tp, sp, rec, cp) for rec in ("none", "selective", "full")]
    from runtime.comm_sweep import Progress
    progress = Progress(len(configs), rank == 0)
    meshes = {(tp, cp): DeviceMesh(current().type, torch.arange(world).reshape(world // (tp * cp), cp, tp),
                                   mesh_dim_names=("dp", "cp", "tp")) if cp > 1 else
              DeviceMesh(current().type, torch.arange(world).reshape(world // tp, tp), mesh_dim_names=("dp", "tp"))
              for tp, cp in {(c[1], c[4]) for c in configs}}
    entries, optimizer_s = [], {}
    for kind, tp, sp, rec, cp in configs:
        entries.append(measure(cfg, kind, meshes[tp, cp], sp, rec, args.mbs, args.seq_len, args.repeats, args.dtype,
                               optimizer_s.get((kind, tp, sp, cp))))
        optimizer_s[kind, tp, sp, cp] = entries[-1]["optimizer_s"]
        progress.step(f"{kind} tp={tp}{' sp' if sp else ''}{f' cp={cp}' if cp > 1 else ''} {rec}")
    pipeline = None
    if world % 2 == 0:  # at micro-batch 1: the runtime's block, unsharded
        blk = next(e for e in entries if (e["layer"], e["tp"], e["recompute"], e.get("cp", 1)) == ("block", 1, "none", 1)) \
            if 1 in args.tps else None
        block_s = (sum(blk["forward_s"]), sum(blk["backward_s"])) if blk else None
        from runtime.profile_pipeline import measure_pipeline
        pipeline = (measure_pipeline(world, args.cluster, args.repeats, cfg, args.seq_len, block_s, dtype=args.dtype)
                    if blk else None)
    if rank != 0:
        return None
    c = args.cluster
    return {
        "format_version": FORMAT_VERSION,
        "name": args.name or f"{cfg.name}@{c.name}",
        "model": load_model(args.model).to_dict(),
        "seq_len": args.seq_len,
        "dtype": args.dtype,
        # what param_bytes count: the runtime's weights, created in torch's default dtype (float32;
        # bf16 computes by autocast over them)
        "param_dtype": {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[torch.get_default_dtype()],
        "sp_saved_inputs": "shard",  # runtime.parallelize.apply_tp's default
        "processes": world,
        "cluster_profile": {"name": c.name, "hash": c.profile_hash},
        "micro_batches": args.mbs,
        "entries": entries,
        **({"pipeline": pipeline} if pipeline else {}),
        "sources": {
            "times": f"measured: median of {args.repeats} samples of back-to-back forward+backward passes (each "
                     f"sample at least {MIN_SAMPLE_S} s) after two warm-up passes, every rank at once, max over ranks; fit a + b * micro_batch by least squares over the measured sizes",
            "activation_bytes": "measured: bytes one forward allocates and keeps until its backward, output "
                                f"included ({_counter_name()}), median of {args.repeats} forwards after a garbage "
                                "collection, with the collector off",
            "optimizer_s": "measured: runtime.optim.clip_grad_norm (local work: reduce=False) + "
                           "AdamW(fused=True).step on the layer's parameters, as the runtime runs them, per copy "
                           "of them streamed through memory (twice the last-level cache; DTensor copies 8 to a call); the norm's all-reduces "
                           "happen once per step, priced by planner.cost",
            "pipeline": "measured: runtime.profile_pipeline.measure_pipeline (two-rank GPipe, 1F1B and interleaved 1F1B of "
                        "one of the model's blocks per stage at micro-batch 1; the per-operation overhead that makes "
                        "planner.schedule, with the block's measured times, reproduce it)",
            "runtime": f"torch {torch.__version__}, {dist.get_backend()} on {current().type}, {args.dtype}"
                       + (" (autocast over float32 weights)" if args.dtype in AMP_DTYPES else "")
                       + ", vocab-parallel loss under TP",
        },
    }
