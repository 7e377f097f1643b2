"""The runtime's mixture-of-experts feed-forward (model.moe; planner.moe prices it) and its tensor
parallelism.

MoEFeedForward: the router, a linear layer hidden -> experts, gives each token a float32 softmax
over the experts; the token's rows go to its experts_per_token most probable, whose outputs are
summed weighted by those probabilities, renormalized over the k (Mixtral's routing, Jiang et al.
2024, section 2.1) or as they are (model.moe.normalize_top_k false: Qwen2-MoE's). The token rows
are sorted by expert and each expert, a SwiGLU MLP of its own parameters (as Hugging Face's
Mixtral holds them), multiplies its contiguous run: a loop over the experts, torch having no
grouped product on CPU. (Weights stacked [experts, ...] for a grouped
product would, in a loop, make the backward hold every expert's gradient twice while it stacks
them.) With a shared expert (Qwen2-MoE) every token also goes through one SwiGLU MLP scaled by a
sigmoid gate. Routing is dropless: an expert takes every row sent to it.

Load balancing (training.moe_aux_loss, attach_aux_loss): each block adds alpha (n / k) sum_i f_i P_i
to the loss, f_i the share of the micro-batch's tokens routed to expert i, P_i its mean router
probability (Fedus et al. 2022, eq. 4; scaled by 1 / k so that a uniform routing gives 1 for any
k). Its gradient enters the backward at the block's output (AuxLoss, Megatron-LM's way of adding a
loss computed inside a pipeline stage), scaled as the runtime scales the main loss's: by the loss
scale, by 1 / micro-batches where no pipeline schedule does it (scale_grads), and by 1 / tp, the
TP ranks each computing it whole into gradients that DTensor sums.

Tensor parallelism (MoETensorParallel, Megatron-LM's way for experts): each expert's gate and up
projections split by columns, its down projection by rows, the same for the shared expert; the
router and the gate are replicated. The block's input is gathered whole on every TP rank (from
sequence shards under sequence parallelism), every rank routes every token alike, and the
weighted sum of its partial expert outputs is all-reduced (reduce-scattered under SP) once, as a
dense MLP's output. Its backward is Megatron-LM's: the gradients of the routing weights (a product
with the partial outputs) are partial sums over the TP ranks, so the router's weight gradient and
the input gradient are declared Partial and DTensor sums them with the experts' ones.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from planner.model import ModelConfig


def _local(p: torch.Tensor, partial: bool = False) -> torch.Tensor:
    """A parameter's local tensor (a DTensor's shard under TP); `partial`: its gradient here is
    this rank's part of a sum over the TP ranks."""
    if isinstance(p, DTensor):
        return p.to_local(grad_placements=[Partial()] if partial else None)
    return p


def swiglu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


def _swiglu_mlp(h: int, f: int) -> nn.ModuleDict:
    """An expert: gate (w1), up (w3) and down (w2) projections, named as runtime.model.FeedForward's."""
    return nn.ModuleDict({"w1": nn.Linear(h, f, bias=False), "w3": nn.Linear(h, f, bias=False),
                          "w2": nn.Linear(f, h, bias=False)})


def _weights(mlp: nn.ModuleDict) -> list[torch.Tensor]:
    return [_local(mlp[n].weight) for n in ("w1", "w3", "w2")]


class AuxLoss(torch.autograd.Function):
    """The block's output unchanged; in the backward, `scale` times the gradient of `aux` (a scalar)."""

    @staticmethod
    def forward(ctx, out, aux, scale: float):
        ctx.scale = scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.scale, dtype=torch.float32, device=grad.device), None


class MoEFeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        n, f, h, fs = cfg.moe.experts, cfg.ffn_hidden, cfg.hidden, cfg.moe.shared_ffn_hidden
        self.k, self.normalize = cfg.moe.experts_per_token, cfg.moe.normalize_top_k
        self.router = nn.Linear(h, n, bias=False)
        self.experts = nn.ModuleList(_swiglu_mlp(h, f) for _ in range(n))
        self.shared = _swiglu_mlp(h, fs) if fs else None
        self.shared_gate = nn.Linear(h, 1, bias=False) if fs else None
        self.aux_scale = None  # () -> the load-balancing loss's gradient scale (attach_aux_loss), else None

    def forward(self, x):
        b, s, h = x.shape
        flat = x.reshape(-1, h)
        probs = F.linear(flat, _local(self.router.weight, partial=True)).float().softmax(dim=-1)
        top, experts = probs.topk(self.k, dim=-1)
        weights = (top / top.sum(dim=-1, keepdim=True) if self.normalize else top).to(x.dtype).flatten()
        order = experts.flatten().argsort(stable=True)  # the rows by expert
        counts = torch.bincount(experts.flatten(), minlength=len(self.experts))
        token = order // self.k
        rows = flat[token]
        out = torch.cat([swiglu(r, *_weights(mlp)) for mlp, r in zip(self.experts, rows.split(counts.tolist()))])
        out = torch.zeros_like(flat).index_add_(0, token, out * weights[order].unsqueeze(-1))
        if self.shared is not None:
            gate = torch.sigmoid(F.linear(flat, _local(self.shared_gate.weight, partial=True)))
            out = out + gate * swiglu(flat, *_weights(self.shared))
        if self.aux_scale is not None and torch.is_grad_enabled():
            aux = len(self.experts) / self.k * (counts.float() / flat.shape[0] * probs.mean(dim=0)).sum()
            out = AuxLoss.apply(out, aux, self.aux_scale())
        return out.view(b, s, h)


class MoETensorParallel(ParallelStyle):
    """Tensor parallelism for an MoEFeedForward (module doc): its input arrives as a local tensor of
    `seq` layout (sequence shards under SP, else whole) and leaves the same way."""

    def __init__(self, sequence_parallel: bool):
        super().__init__()
        self.seq = Shard(1) if sequence_parallel else Replicate()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        split = {"w1": 0, "w3": 0, "w2": 1}  # an expert's columns; the router and the gate replicated

        def partition(name, mod, mesh):
            dim = split.get(name.rpartition(".")[2]) if name.startswith(("experts.", "shared.")) else None
            for pname, p in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(pname, nn.Parameter(distribute_tensor(
                    p, mesh, [Replicate() if dim is None else Shard(dim)])))

        def gather(mod, inputs, mesh):  # whole tokens here; their gradient a partial sum, reduced by DTensor
            x = inputs[0]  # SequenceParallel's norm hands a DTensor on
            x = x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [self.seq], run_check=False)
            return (x.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()]),)

        def reduce(mod, out, mesh):
            return DTensor.from_local(out, mesh, [Partial()], run_check=False).redistribute(mesh, [self.seq]).to_local()

        return distribute_module(module, device_mesh, partition, gather, reduce)


def attach_aux_loss(chunks, plan, scaler) -> None:
    """Each MoE block of the chunks adds training.moe_aux_loss times its load-balancing loss (module
    doc), scaled as the main loss: by `scaler`'s loss scale (runtime.loss_scale), 1 / micro-batches
    without a pipeline schedule (runtime.train._accumulate divides the loss), 1 / tp."""
    alpha = plan.training.moe_aux_loss
    if not alpha:
        return
    per = alpha / plan.mesh.tp / (1 if plan.mesh.pp > 1 else plan.pipeline.micro_batches)
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, MoEFeedForward):
                module.aux_scale = lambda: per * scaler.scale
