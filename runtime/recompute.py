"""Activation recomputation that replays a region once per micro-batch, however many backward
calls read it: what a split backward (zbv's I and W, runtime.pipeline) needs.

torch.utils.checkpoint (non-reentrant) replays a region in every backward call that reads its
saved tensors and frees each replayed tensor once read. Under a split backward both I (input
gradients) and W (weight gradients) read a block's saved tensors, and W makes one backward call
per parameter group (torch.distributed.pipelining's stage_backward_weight): a fully recomputed
block was replayed once in I and once per group in W (measured: 2 replays in I and 18 in W for
two blocks, tests/test_recompute.py). Running I and W as one group of backward calls
(torch.utils.checkpoint.GraphExecGroup) fails, since I and W run some of the same autograd nodes
("Unpack is being triggered for a tensor that was already unpacked once", torch 2.13).

`replay_once(fn, *args)` runs `fn` keeping none of the tensors autograd saves inside it, only an
index per tensor (torch.autograd.graph.saved_tensors_hooks). The first time a backward reads one,
it replays `fn` on the region's inputs (same autocast and random number state as the forward) and
keeps everything the replay saved; later reads, in the same or another backward call, take the
kept tensors. They are freed with the autograd graph that holds the indices: under a split
backward at the end of W, as if the block had not been recomputed since I (what
planner.memory counts: the replay held from each I to its W); the planner prices the replay once,
in I (planner.layers.layer_cost).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.autograd.graph import saved_tensors_hooks


class _Region:
    """One call's inputs, how to replay it, and (once replayed) the tensors its replay saved."""

    def __init__(self, fn: Callable, args: tuple):
        self.fn, self.args = fn, args
        self.packed = 0
        self.saved: list | None = None
        self.device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
        self.amp = (torch.is_autocast_enabled(self.device), torch.get_autocast_dtype(self.device))
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state() if self.device == "cuda" else None

    def pack(self, _tensor):
        self.packed += 1
        return self.packed - 1

    def unpack(self, index: int):
        if self.saved is None:
            self._replay()
        return self.saved[index]

    def _replay(self):
        saved: list = []

        def keep(t):  # detached: an op's saved output would otherwise hold the replay's graph, which
            saved.append(t.detach())  # holds this hook: a cycle through C++ that gc cannot free

        def never(_):
            raise RuntimeError("replay_once: a replayed region's own graph is never back-propagated")
        inputs = tuple(a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
                       for a in self.args)
        devices = [torch.cuda.current_device()] if self.cuda_rng is not None else []
        with torch.random.fork_rng(devices=devices, device_type=self.device if devices else "cuda"):
            torch.set_rng_state(self.cpu_rng)
            if self.cuda_rng is not None:
                torch.cuda.set_rng_state(self.cuda_rng)
            amp = torch.autocast(self.device, dtype=self.amp[1], enabled=self.amp[0], cache_enabled=False)
            with torch.enable_grad(), amp, saved_tensors_hooks(keep, never):
                self.fn(*inputs)
        if len(saved) != self.packed:
            raise RuntimeError(f"replay_once: the replay saved {len(saved)} tensors where the forward saved "
                               f"{self.packed}; the region is not deterministic")
        self.saved = saved


def per_op_contexts():
    """torch.utils.checkpoint's context_fn for torchtitan's per-op selective recomputation
    (planner.sac): the outputs of matrix products (aten.mm) but every second one, of fused attention
    (CUDA's flash and efficient kernels, CPU's flash kernel), of reduce-scatters and of aten.max are
    kept; everything else in the region is replayed in the backward."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
    from planner.sac import product_saved
    ops = torch.ops.aten
    keep = {ops.mm.default, ops._scaled_dot_product_flash_attention.default,
            ops._scaled_dot_product_efficient_attention.default,
            ops._scaled_dot_product_flash_attention_for_cpu.default,
            torch.ops._c10d_functional.reduce_scatter_tensor.default, ops.max.default}
    counts = {"forward": 0, "recompute": 0}

    def policy(ctx, func, *args, **kwargs):
        if func == ops.mm.default:  # the forward and its replay count their products apart
            key = "recompute" if ctx.is_recompute else "forward"
            counts[key] += 1
            if not product_saved(counts[key]):
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in keep else CheckpointPolicy.PREFER_RECOMPUTE
    return create_selective_checkpoint_contexts(policy)


def replay_once(fn: Callable, *args):
    """fn(*args), its saved tensors replayed at most once (module doc)."""
    region = _Region(fn, args)
    with saved_tensors_hooks(region.pack, region.unpack):
        return fn(*args)
