"""Sequence parallelism that keeps shards: the input a module all-gathers for its column-parallel
linears is kept for the backward as this rank's sequence shard and gathered again when the
backward reads it (training.sp_saved_inputs "shard", the default).

Under DTensor's sequence parallelism (PrepareModuleInput to Replicate, then ColwiseParallel) the
matrix products save the gathered input, whole on every rank: the attention's q/k/v projections
and the FFN's first projections each keep s x b x h elements where the residual stream around
them is split tp ways. Megatron-LM keeps the shard and all-gathers it again in the backward
(LinearWithGradAccumulationAndAsyncCommunication; Korthikanti et al. 2022, section 4.2.2), which
is what planner.model.ModelConfig.activation_bytes counts. `keep_shards` does the same for a
module: a forward pre-hook placed before the module's input preparation takes the shard it
receives; one after it notes the gathered DTensor and, for the module's forward, swaps every
tensor autograd saves that is the gathered input, a view of it, or a cast of it (autocast casts
the input once per linear) for a reference to the shard (torch.autograd.graph.saved_tensors_hooks).
The first read in the backward all-gathers the shard once for all the linears that read it; the
whole tensor is dropped when the last of them has read it. A split backward (zbv) reads every
saved tensor in I and again in W, and so gathers each kept input twice, once in each. Values are
exact: an all-gather moves bits, and a cast of the gathered input equals the gathered input cast.
The planner prices the extra all-gather in the backward (planner.comm.tp_comm).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor, Replicate, Shard


class _Gathered:
    """One forward's gathered input: the shard it came from and, while a backward pass reads it,
    the gathered tensor again (one per dtype it was saved in). Each pass over the graph reads
    every saved reference once: a backward once, a split backward (zbv) in I and again in W."""

    def __init__(self, shard: DTensor, mesh, numel: int):
        self.shard, self.mesh, self.numel = shard.detach(), mesh, numel
        self.saved = self.left = 0  # references autograd keeps; those the pass reading has yet to read
        self.whole: dict = {}

    def save(self) -> None:
        self.saved += 1
        self.left += 1

    def read(self, dtype) -> torch.Tensor:
        if dtype not in self.whole:
            self.whole[dtype] = self.shard.full_tensor().to(dtype)
        out = self.whole[dtype]
        self.left -= 1
        if self.left <= 0:  # the pass's last reader: drop it; a next pass (W after I) gathers it once more
            self.whole, self.left = {}, self.saved
        return out


class _Ref:
    """What autograd keeps instead of a saved tensor taken from the gathered input: its view."""
    __slots__ = ("src", "dtype", "size", "stride", "offset", "shape", "gstride")

    def __init__(self, src: _Gathered, t: DTensor, local: torch.Tensor):
        self.src, self.dtype = src, local.dtype
        self.size, self.stride, self.offset = local.size(), local.stride(), local.storage_offset()
        self.shape, self.gstride = t.shape, t.stride()


def _local(t: DTensor) -> torch.Tensor:
    """A DTensor's local tensor, waited for where a collective still produces it."""
    local = t._local_tensor
    return local.wait() if isinstance(local, AsyncCollectiveTensor) else local


def _pack_for(src: _Gathered, x: DTensor):
    ptr, dtype = _local(x).untyped_storage().data_ptr(), x.dtype

    def pack(t):
        if isinstance(t, DTensor) and t.placements == (Replicate(),) and t.numel() == src.numel:
            local = _local(t)
            if local.untyped_storage().data_ptr() == ptr or (t.dtype != dtype and local.is_contiguous()):
                src.save()  # the gathered input, a view of it, or a cast of it
                return _Ref(src, t, local)
        # anything else as itself, detached: an op's saved output would hold, through its grad_fn,
        # the node that saves it, a cycle through C++ that gc cannot free. A backward frees it by
        # releasing what it read; a split backward's I keeps the graph (retain_graph) and W reads
        # only what leads to the weights, so without the detach every micro-batch's other saved
        # outputs (a norm's rsqrt, the attention's output) were never freed: +23.5 MiB a step on a
        # pp 2 x tp 2 zbv plan of the 8-block tiny model (PyTorch's saved-tensor hooks docs, #153049)
        return t.detach()
    return pack


def _unpack(r):
    if not isinstance(r, _Ref):
        return r
    view = r.src.read(r.dtype).as_strided(r.size, r.stride, r.offset)
    return DTensor.from_local(view, r.src.mesh, [Replicate()], run_check=False, shape=r.shape, stride=r.gstride)


def keep_shards(module: nn.Module, mesh, active: Callable[[], bool]) -> None:
    """Keep the sequence shard of what `module`'s input preparation gathers (a forward pre-hook
    already registered on it: PrepareModuleInput, or ColwiseParallel's input_layouts) for every
    forward while `active()` (not under full recomputation, whose checkpoint keeps the block's
    input alone)."""
    state: dict = {}

    def take_shard(mod, args):
        if active() and torch.is_grad_enabled():
            state["shard"] = args[0]

    def enter(mod, args):
        shard, x = state.pop("shard", None), args[0]
        if shard is None or not isinstance(x, DTensor):
            return
        local = _local(x)
        if not local.is_contiguous() or local.storage_offset():  # the layout an all-gather returns, as _unpack rebuilds
            return
        if not isinstance(shard, DTensor):  # a local tensor: this rank's sequence shard
            shard = DTensor.from_local(shard, mesh, [Shard(1)], run_check=False)
        if shard.placements != (Shard(1),):
            return
        ctx = saved_tensors_hooks(_pack_for(_Gathered(shard, mesh, x.numel()), x), _unpack)
        ctx.__enter__()
        state["ctx"] = ctx

    def leave(mod, args, out):
        ctx = state.pop("ctx", None)
        if ctx is not None:
            ctx.__exit__(None, None, None)

    module.register_forward_pre_hook(take_shard, prepend=True)
    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave)
