"""Run by tests/test_sequence_parallel.py under torchrun (2 gloo processes): the tiny model under
TP 2 with sequence parallelism, keeping shards (runtime.sp_shard) and keeping the gathered inputs.
Prints one JSON line from rank 0: the C heap a forward grows by and keeps until its backward
(the least of 5, each mode in turn, the collector off: a collective still in flight when a forward
returns adds its buffers to some readings, never takes from them; on a loaded host 5 of 191
medians read 192 KiB more), in float32 and under bf16 autocast over the
float32 weights (the runtime's mixed precision without data parallelism), whether both modes
give the same loss and gradients bit for bit, and how many all-gathers of kept shards a split
backward (zbv's I, then W: torch.distributed.pipelining's stage_backward_input and _weight) of
two blocks runs in each part and the C heap each of three such passes leaves behind, and how runtime.optim.reduce_partial_grads makes the norms' partial
gradients whole (with Qwen3's q and k norms): how many, in how many all-reduces, whether they
equal DTensor's own reduction of each, and how far every gradient is from one process's; and the
same with the norms run as CUDA runs them (fused_norms)."""
import contextlib
import dataclasses
import gc
import json

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from planner.zoo import ZOO
from runtime.loss import cross_entropy
from runtime.metrics import HEAP_READER
from runtime.model import Transformer, init_weights
from runtime.parallelize import apply_tp
from runtime.sp_shard import _Gathered

MICRO_BATCH, SEQ = 4, 64


def build(keep: bool, mesh, layers=None, cfg=ZOO["tiny"]):
    with torch.device("meta"):
        chunk = Transformer(cfg, *(layers or ()))
    apply_tp(chunk, mesh, True, keep_shards=keep)
    chunk.to_empty(device="cpu")
    chunk.init_buffers("cpu")
    init_weights(chunk, 0)
    return chunk


def step(chunk, ids, group, rank):
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        logits = chunk(ids[:, :-1])
    loss = cross_entropy(logits, ids[:, 1:], group, rank)
    loss.backward()
    return loss.item(), [p.grad.to_local().clone() for p in chunk.parameters()]


def measure(rank: int) -> dict:
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    ids = torch.randint(0, ZOO["tiny"].vocab, (MICRO_BATCH, SEQ + 1))
    chunks = {keep: build(keep, mesh) for keep in (True, False)}
    results = {keep: step(c, ids, mesh.get_group(), rank) for keep, c in chunks.items()}  # warm-up, and the values
    same = results[True][0] == results[False][0] and all(
        torch.equal(a, b) for a, b in zip(results[True][1], results[False][1]))
    kept = {(keep, amp): [] for keep in (True, False) for amp in (False, True)}
    for _ in range(5):
        for (keep, amp), samples in kept.items():
            chunk = chunks[keep]
            gc.collect()
            gc.disable()
            dist.barrier()
            before = HEAP_READER()
            with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False) if amp else contextlib.nullcontext():
                out = chunk(ids[:, :-1]).float().sum()
            samples.append(HEAP_READER() - before)
            gc.enable()
            out.backward()
            del out
            for p in chunk.parameters():
                p.grad = None
    return {f"{'shard' if keep else 'gathered'}{'-bf16' if amp else ''}": min(v)
            for (keep, amp), v in kept.items()} | {"same": same, "split_gathers": split_gathers(mesh),
                                                   "partial_grads": partial_grads(mesh),
                                                   "fused_norms": fused_norms(mesh)}


def split_gathers(mesh) -> dict:
    """All-gathers of kept shards in I and in W of two blocks' split backward, and the C heap it
    leaves behind once its tensors and gradients are gone (saved tensors whose autograd node
    outlives the graph: what I leaves for W never reads)."""
    gathers, read = [0], _Gathered.read

    def counting(self, dtype):
        gathers[0] += dtype not in self.whole
        return read(self, dtype)
    _Gathered.read = counting
    try:
        blocks = build(True, mesh, (1, 3))
        left = []
        for _ in range(3):  # the first pass also builds DTensor's caches
            gathers[0] = 0
            gc.collect()
            before = HEAP_READER()
            x = torch.randn(2, SEQ // 2, ZOO["tiny"].hidden, requires_grad=True)  # this rank's sequence shard
            out = blocks(x)
            _, groups = stage_backward_input([out], [torch.ones_like(out)], [x], blocks.parameters())
            i_pass = gathers[0]
            stage_backward_weight(blocks.parameters(), groups)
            del x, out, groups
            for p in blocks.parameters():
                p.grad = None
            gc.collect()
            left.append(HEAP_READER() - before)
        return {"I": i_pass, "W": gathers[0] - i_pass, "left": left}
    finally:
        _Gathered.read = read


def partial_grads(mesh) -> dict:
    """On tiny with Qwen3's per-head q and k norms (their gradients partial sums too, with or
    without SP), in float32: the partial gradients made whole, and every gradient against one
    process's."""
    from runtime.optim import reduce_partial_grads
    cfg = dataclasses.replace(ZOO["tiny"], qk_norm=True)
    chunk = build(True, mesh, cfg=cfg)
    ids = torch.randint(0, cfg.vocab, (2, SEQ + 1), generator=torch.Generator().manual_seed(1))
    cross_entropy(chunk(ids[:, :-1]), ids[:, 1:], mesh.get_group(), mesh.get_local_rank()).backward()
    one = Transformer(cfg)
    init_weights(one, 0)
    cross_entropy(one(ids[:, :-1]), ids[:, 1:]).backward()
    params = list(chunk.parameters())
    partial = [p for p in params if any(pl.is_partial() for pl in p.grad.placements)]
    whole = [p for p in params if not any(pl.is_partial() for pl in p.grad.placements)]
    expected = [p.grad.full_tensor() for p in partial]
    others = [p.grad.to_local().clone() for p in whole]
    calls, all_reduce = [0], dist.all_reduce

    def counting(*args, **kwargs):
        calls[0] += 1
        return all_reduce(*args, **kwargs)
    dist.all_reduce = counting
    try:
        reduce_partial_grads(params)
    finally:
        dist.all_reduce = all_reduce
    same = all(torch.allclose(p.grad.to_local(), e, rtol=1e-6, atol=0) for p, e in zip(partial, expected)) and all(
        torch.equal(p.grad.to_local(), o) for p, o in zip(whole, others))
    worst = max(((p.grad.full_tensor() - q.grad).abs().max() / q.grad.abs().max()).item()
                for p, q in zip(params, one.parameters()))
    return {"partial": len(partial), "numel": sum(p.numel() for p in partial), "all_reduces": calls[0], "whole": same,
            "left": sum(any(pl.is_partial() for pl in p.grad.placements) for p in params), "vs_one": worst}


def fused_norms(mesh) -> dict:
    """The same model's step with every RMSNorm run as aten._fused_rms_norm, the kernel F.rms_norm
    dispatches to on CUDA (on CPU it decomposes), so through DTensor's sharding rules for that op
    and its backward (the SP norms' sequence shards, the q and k norms' heads): how many norms
    took it, and how far its loss and gradients are from the decomposed ones'."""
    import torch.nn.functional as F
    cfg = dataclasses.replace(ZOO["tiny"], qk_norm=True)
    ids = torch.randint(0, cfg.vocab, (2, SEQ + 1), generator=torch.Generator().manual_seed(2))

    def run():
        chunk = build(True, mesh, cfg=cfg)
        loss = cross_entropy(chunk(ids[:, :-1]), ids[:, 1:], mesh.get_group(), mesh.get_local_rank())
        loss.backward()
        return loss.item(), [p.grad.full_tensor() for p in chunk.parameters()]
    decomposed, calls, rms_norm = run(), [0], F.rms_norm

    def fused(x, shape, weight=None, eps=None):
        calls[0] += 1
        return torch.ops.aten._fused_rms_norm(x, list(shape), weight, eps)[0]
    F.rms_norm = fused
    try:
        got = run()
    finally:
        F.rms_norm = rms_norm
    worst = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got[1], decomposed[1]))
    return {"calls": calls[0], "loss": abs(got[0] - decomposed[0]), "worst": worst}


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    got = measure(rank)
    if rank == 0:
        print(json.dumps(got), flush=True)
    # Free the models and meet before the process group goes. Without this (rank 0 printing while
    # rank 1 destroyed the group, the models freed after it), 3 of 63 runs on a loaded host aborted
    # at exit with "terminate called without an active exception" (rank 1, no Python frame left);
    # with it, none of 104.
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
