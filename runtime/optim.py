"""Gradient clipping over a model however it is split (DTensor shards, pipeline ranks), the
reduction of partial gradients before the optimizer step, and the learning rate of each step."""
from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist


def param_groups(chunk, weight_decay: float) -> list[dict]:
    """AdamW's parameter groups of a chunk: weight decay on its matrices (linear weights,
    embeddings), none on its vectors (norm weights, biases), as Megatron-LM (its default
    no_weight_decay_cond), nanoGPT and Hugging Face's Trainer decay them. A DTensor's ndim is its
    global one, so the split is the same under every plan."""
    params = list(chunk.parameters())
    groups = ({"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0})
    return [g for g in groups if g["params"]]


def reset_weight_decay(optimizers, weight_decay: float) -> None:
    """Give the groups of param_groups the plan's weight decay again: loading a checkpoint sets each
    group's hyperparameters to the saved ones (torch's set_optimizer_state_dict), which a plan
    allowed to change them (--allow-change weight_decay) or a checkpoint from before the split
    (everything decayed) would otherwise keep."""
    for opt in optimizers:
        for group in opt.param_groups:
            group["weight_decay"] = weight_decay if group["params"][0].ndim >= 2 else 0.0


@torch.no_grad()
def clip_grad_norm(params: list, max_norm: float, pp_group, device: torch.device, timing: dict | None = None,
                   reduce: bool = True, uncounted=None, inv_scale: float = 1.0, ep=None) -> float:
    """Clip to a total norm over every parameter of the model, however it is split. The squares of
    the local shards are summed per (mesh, sharded mesh dims) and each sum is all-reduced over its
    sharded dims once (not one collective per DTensor); replicated dims hold copies and are not
    summed; then the total is summed over the pipeline ranks. Returns the norm before clipping.
    `timing["pp_wait_s"]` gets the time of the pipeline all-reduce, which waits for the other
    pipeline ranks' last backward, `timing["norm_s"]` that of the sums' all-reduces, which wait
    for the other ranks of their groups (processes that share cores end their backwards apart).
    `reduce=False` skips every collective (the profiler times the
    local work; the planner prices the collectives, once per step). `uncounted`: a parameter whose
    gradient is clipped but not counted (a tied matrix's copy, counted with the embedding: runtime.tied).
    `inv_scale`: the gradients are of a loss scaled by 1 / inv_scale (runtime.loss_scale): the norm
    returned is the unscaled one, and the gradients are unscaled with the clipping; an inf or NaN
    norm (an fp16 overflow) leaves them as they are. `ep`: the EP mesh under expert parallelism
    (runtime.moe), whose ranks hold other experts: the sums over the experts' meshes (their "edp"
    dimension, "edp_cp" under context parallelism) are summed over it too."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    sq = torch.zeros((), dtype=torch.float64, device=device)
    sums: dict = {}
    for g in (p.grad for p in params if p.grad is not None and p is not uncounted):
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            sq += torch.linalg.vector_norm(g, dtype=torch.float32).full_tensor().double() ** 2
        elif isinstance(g, DTensor):
            # every dim that splits it, FSDP2's _StridedShard over a TP split included (which torch
            # 2.13 does not count as is_shard(): its dp sum was missed, the norm of a dp x tp plan low)
            dims = tuple(i for i, pl in enumerate(g.placements) if not pl.is_replicate())
            local = torch.linalg.vector_norm(g.to_local(), dtype=torch.float32).double() ** 2
            entry = sums.setdefault((id(g.device_mesh), dims), [g.device_mesh, dims, torch.zeros_like(sq)])
            entry[2] += local
        else:
            sq += torch.linalg.vector_norm(g, dtype=torch.float32).double() ** 2
    t0 = time.perf_counter()
    for mesh, dims, part in sums.values():  # the same order on every rank: parameter order
        for d in dims if reduce else ():
            dist.all_reduce(part, group=mesh.get_group(d))
        if ep is not None and reduce and {"edp", "edp_cp"} & set(mesh.mesh_dim_names or ()):
            dist.all_reduce(part, group=ep.get_group())
        sq += part
    if timing is not None:
        timing["norm_s"] = time.perf_counter() - t0
    if pp_group is not None and reduce:
        t0 = time.perf_counter()
        dist.all_reduce(sq, group=pp_group)
        if timing is not None:
            timing["pp_wait_s"] = time.perf_counter() - t0
    total = float(sq.sqrt()) * inv_scale
    coef = inv_scale * (max_norm / (total + 1e-6) if max_norm > 0 and total > max_norm else 1.0)
    if coef != 1.0 and math.isfinite(total):
        torch._foreach_mul_([g.to_local() if isinstance(g, DTensor) else g for g in grads], coef)
    return total


@torch.no_grad()
def reduce_partial_grads(params: list, reduce: bool = True, timing: dict | None = None) -> None:
    """Make every gradient that is a partial sum over mesh dimensions (the norms' weights under
    sequence parallelism without data parallelism: each TP rank normalized its own tokens; FSDP2
    reduces them itself) whole, with one all-reduce of all of them per mesh dimension, as
    Megatron-LM all-reduces its sequence-parallel norms' gradients over the TP group once a step.
    Left partial, each foreach op of AdamW's step that reads one all-reduces it again (9 of the
    tiny model's norms on 2 processes: 33.7 against 1.9 ms a step). `reduce=False`: the same
    placements without the collective (the profiler times the local work); `timing["partial_s"]`
    gets the time of the all-reduces."""
    from torch.distributed.tensor import DTensor, Replicate
    groups: dict = {}
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            if any(pl.is_partial() and pl.reduce_op != "sum" for pl in g.placements):
                raise ValueError(f"a gradient is a partial {g.placements}; only sums are reduced here")
            dims = tuple(i for i, pl in enumerate(g.placements) if pl.is_partial())
            groups.setdefault((id(g.device_mesh), dims, g.dtype), []).append(p)
    for (_, dims, _), ps in groups.items():  # the same order on every rank: parameter order
        mesh, local = ps[0].grad.device_mesh, [p.grad.to_local() for p in ps]
        flat = torch.cat([t.reshape(-1) for t in local])
        t0 = time.perf_counter()
        for d in dims if reduce else ():
            dist.all_reduce(flat, group=mesh.get_group(d))
        if timing is not None:
            timing["partial_s"] = timing.get("partial_s", 0.0) + time.perf_counter() - t0
        offset = 0
        for p, t in zip(ps, local):
            whole = [Replicate() if pl.is_partial() else pl for pl in p.grad.placements]
            p.grad = DTensor.from_local(flat[offset:offset + t.numel()].view_as(t), mesh, whole, run_check=False,
                                        shape=p.grad.shape, stride=p.grad.stride())
            offset += t.numel()


def lr_at(t, step: int) -> float:
    """The learning rate of step `step` (0-based) under training `t`'s schedule (planner.plan.Training):
    lr (s + 1) / (w + 1) over the w warm-up steps (never 0, as torchtitan's warm-up starts), then
    from lr to min_lr by lr_decay over steps w .. lr_decay_steps, min_lr after. A function of the
    step alone, so that a resumed run takes the rates of an uninterrupted one."""
    w = t.lr_warmup_steps
    if step < w:
        return t.lr * (step + 1) / (w + 1)
    if t.lr_decay == "constant":
        return t.lr
    done = min(1.0, (step - w) / (t.lr_decay_steps - w))
    left = 1.0 - done if t.lr_decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * done))
    return t.min_lr + (t.lr - t.min_lr) * left
