"""Tied embeddings across pipeline stages, as Megatron-LM ties them (its embedding group): the
stage that holds the head keeps its own copy of the embedding's matrix, initialized equal
(runtime.model.init_weights), and after every backward the two gradients are summed: all-reduced
between the two pipeline ranks that hold them (a group of two for each coordinate of the other
mesh dimensions) or added where one rank holds both (ZB-V's rank 0). Both copies then take the
same optimizer step and stay equal; the gradient norm counts the matrix once, leaving the copy
out. Where the two stages shard gradients alike (both ZeRO 0 or both 1-3, and TP's vocabulary
rows) their local shards are summed as they are; otherwise whole, each keeping its slice.
Where one stage holds both, they are one parameter (runtime.parallelize.retie) and nothing here
applies."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from planner.comm import tied_ends

EMBEDDING = "layers.0.tok_embeddings.weight"


def head_weight(cfg) -> str:
    """The name of the head's projection, the embedding's copy where a pipeline splits them."""
    return f"layers.{cfg.num_layers_total - 1}.output.weight"


def _local(g):
    return g.to_local() if hasattr(g, "to_local") else g


class TiedMatrix:
    """This rank's part in keeping a tied embedding and its copy in the head equal."""

    def __init__(self, plan, pp_group, chunks):
        cfg = plan.model
        self.params, self.copy, self.group, self.whole = [], None, None, False
        if not cfg.tie_embeddings or len(plan.pipeline.stages) == 1:
            return
        for chunk in chunks:
            named = dict(chunk.named_parameters())
            self.params += [named[n] for n in (EMBEDDING, head_weight(cfg)) if n in named]
            self.copy = named.get(head_weight(cfg), self.copy)
        first, end, sharded = tied_ends(plan)
        self.whole = sharded[0] != sharded[1]
        if self.params and first != end:
            line = dist.get_process_group_ranks(pp_group)  # this rank's pipeline ranks, in pp order
            self.group = dist.new_group([line[first], line[end]], use_local_synchronization=True)

    @torch.no_grad()
    def sync(self, timing: dict | None = None) -> None:
        """Sum the two gradients into both (timing["tied_s"]: the seconds of the collectives)."""
        if not self.params:
            return
        t0 = time.perf_counter()
        grads = [p.grad for p in self.params]
        if self.whole:
            total = sum(g.full_tensor() if hasattr(g, "full_tensor") else g for g in grads)
        else:
            total = sum(_local(g) for g in grads)
        if self.group is not None:
            dist.all_reduce(total, group=self.group)
        for g in grads:
            if self.whole and hasattr(g, "device_mesh"):
                from torch.distributed.tensor import distribute_tensor
                _local(g).copy_(distribute_tensor(total, g.device_mesh, g.placements, src_data_rank=None).to_local())
            else:
                _local(g).copy_(total)
        if timing is not None:
            timing["tied_s"] = time.perf_counter() - t0
