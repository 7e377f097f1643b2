"""The runtime's mixture-of-experts feed-forward (model.moe; planner.moe prices it) and its tensor
parallelism.

MoEFeedForward: the router, a linear layer hidden -> experts, gives each token a float32 softmax
over the experts; the token's rows go to its experts_per_token most probable, whose outputs are
summed weighted by those probabilities, renormalized over the k (Mixtral's routing, Jiang et al.
2024, section 2.1) or as they are (model.moe.normalize_top_k false: Qwen2-MoE's). The token rows
are sorted by expert and each expert, a SwiGLU MLP of its own parameters (as Hugging Face's
Mixtral holds them), multiplies its contiguous run: a loop over the experts. (torch 2.13's
torch._grouped_mm runs on CPU too, but stacking the experts' weights for it each forward made the
tiny MoE blocks slower here, 51-52 against 44-46 ms; weights held stacked [experts, ...] would, in
a loop, make the backward hold every expert's gradient twice while it stacks them.) With a shared
expert (Qwen2-MoE) every token also goes through one SwiGLU MLP scaled by a sigmoid gate. Routing
is dropless: an expert takes every row sent to it.

Load balancing (training.moe_aux_loss, attach_routing): each block adds alpha (n / k) sum_i f_i P_i
to the loss, f_i the share of the micro-batch's tokens routed to expert i, P_i its mean router
probability (Fedus et al. 2022, eq. 4; scaled by 1 / k so that a uniform routing gives 1 for any
k). Under context parallelism a rank holds part of each sequence: the CP group sums its routed
counts (an all-reduce of n floats a block), so f_i is the whole sequence's, and each rank's P_i of
its own tokens, whose gradients the CP ranks average, average to the whole sequence's P_i: the
loss and its gradient are one process's (Megatron-LM's router, too, reduces this loss's counts
over its tensor-and-context-parallel group). Its gradient enters the backward at the block's
output (AuxLoss, Megatron-LM's way of adding a loss computed inside a pipeline stage), scaled as
the runtime scales the main loss's: by the loss scale, by 1 / micro-batches where no pipeline
schedule does it (scale_grads), and by 1 / tp, the TP ranks each computing it whole into
gradients that DTensor sums.

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

import contextlib

import torch
import torch.distributed as dist
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


class Expert(nn.Module):
    """A SwiGLU expert: gate (w1), up (w3) and down (w2) projections, named as runtime.model.
    FeedForward's; a module with a forward, so that FSDP2 can gather it as a group of its own
    (expert parallelism: runtime.parallelize.apply_data_parallel)."""

    def __init__(self, h: int, f: int):
        super().__init__()
        self.w1, self.w3 = nn.Linear(h, f, bias=False), nn.Linear(h, f, bias=False)
        self.w2 = nn.Linear(f, h, bias=False)

    def forward(self, x, grad_scale: float | None = None):
        """`grad_scale`: the weights' gradients scaled so (expert parallelism's 1 / ep)."""
        ws = [_local(lin.weight) for lin in (self.w1, self.w3, self.w2)]
        return swiglu(x, *(ws if grad_scale is None else (_GradScale.apply(w, grad_scale) for w in ws)))


_UNCOUNTED = [False]  # a forward run to learn shapes (uncounted), not to train


@contextlib.contextmanager
def uncounted():
    """Forwards whose balancing loss neither counts nor enters a gradient: torch.distributed.pipelining's
    shape inference of a stage's first micro-batch, whose autograd graph its last stage differentiates."""
    _UNCOUNTED[0] = True
    try:
        yield
    finally:
        _UNCOUNTED[0] = False


class AuxLoss(torch.autograd.Function):
    """The block's output unchanged; in the backward, `scale` times the gradient of `aux` (a scalar),
    and the value of `aux` appended to `seen` (a list): once for each forward differentiated, so not
    for a pipeline stage's shape inference nor for a recomputation's replay whose graph is not."""

    @staticmethod
    def forward(ctx, out, aux, scale: float, seen: list):
        ctx.scale, ctx.aux, ctx.seen = scale, aux.detach(), seen
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        if ctx.seen is not None:
            ctx.seen.append(ctx.aux)
        return grad, torch.full((), ctx.scale, dtype=torch.float32, device=grad.device), None, None


class _GradScale(torch.autograd.Function):
    """The tensor unchanged; its gradient times `scale`."""

    @staticmethod
    def forward(ctx, t, scale: float):
        ctx.scale = scale
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


class MoEFeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        n, f, h, fs = cfg.moe.experts, cfg.ffn_hidden, cfg.hidden, cfg.moe.shared_ffn_hidden
        self.k, self.normalize = cfg.moe.experts_per_token, cfg.moe.normalize_top_k
        self.router = nn.Linear(h, n, bias=False)
        # by global index: under expert parallelism a rank keeps its own (apply_expert_parallel)
        self.experts = nn.ModuleDict({str(j): Expert(h, f) for j in range(n)})
        self.n = n
        self.ep = None  # (group, size, first expert) under expert parallelism, else None
        self.cp = None  # (group, size) of the CP group where the balancing loss spans it (attach_routing)
        self.shared = Expert(h, fs) if fs else None
        self.shared_gate = nn.Linear(h, 1, bias=False) if fs else None
        self.aux_scale = None  # () -> the load-balancing loss's gradient scale (attach_routing), else None
        self.aux_seen: list = []  # the balancing losses of this step's micro-batches (AuxLoss, RoutingMeter)
        self.loads: list | None = None  # each forward's rows an expert, where a RoutingMeter reads them

    def forward(self, x):
        b, s, h = x.shape
        flat = x.reshape(-1, h)
        probs = F.linear(flat, _local(self.router.weight, partial=True)).float().softmax(dim=-1)
        top, experts = probs.topk(self.k, dim=-1)
        weights = (top / top.sum(dim=-1, keepdim=True) if self.normalize else top).to(x.dtype).flatten()
        counts = torch.bincount(experts.flatten(), minlength=self.n)
        if self.ep is None:
            order = experts.flatten().argsort(stable=True)  # the rows by expert
            token = order // self.k
            runs = flat[token].split(counts.tolist())
            out = torch.cat([expert(r) for expert, r in zip(self.experts.values(), runs)])
            out = torch.zeros_like(flat).index_add_(0, token, out * weights[order].unsqueeze(-1))
        else:
            out = self._expert_parallel(flat, experts, weights.view(-1, self.k))
        if self.shared is not None:
            gate = torch.sigmoid(F.linear(flat, _local(self.shared_gate.weight, partial=True)))
            out = out + gate * self.shared(flat)
        if self.loads is not None and torch.is_grad_enabled() and not _UNCOUNTED[0]:
            self.loads.append(counts)  # RoutingMeter's load factor
        if self.aux_scale is not None and torch.is_grad_enabled():
            routed = counts.float()
            if self.cp is not None:  # the whole sequence's shares f_i (module doc)
                dist.all_reduce(routed, group=self.cp[0])
                routed = routed / self.cp[1]
            aux = self.n / self.k * (routed / flat.shape[0] * probs.mean(dim=0)).sum()
            # neither counted nor differentiated in a pipeline stage's shape inference (runtime.pipeline)
            out = AuxLoss.apply(out, aux, *((0.0, None) if _UNCOUNTED[0] else (self.aux_scale(), self.aux_seen)))
        return out.view(b, s, h)

    def _expert_parallel(self, flat: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The weighted sum of each token's experts' outputs (`flat` [tokens, h], the chosen
        `experts` and their `weights` [tokens, k]) where the experts are spread over the EP group:
        each token goes once to each rank holding any of its experts (as DeepEP's dispatch does:
        github.com/deepseek-ai/DeepEP, get_dispatch_layout's is_token_in_rank), with the weights
        of that rank's experts and which of them it chose (one all-to-all, torch.distributed.nn's,
        whose backward is the reverse exchange); the rank runs its experts on the rows chosen for
        them and sends back each token's weighted sum of them, which the token's own rank adds up.
        The experts' weight gradients are scaled by 1 / ep: a rank's experts compute the rows of all
        ep ranks, and FSDP2 averages them over the dp / ep ranks holding the same experts only."""
        from torch.distributed.nn.functional import all_to_all_single
        group, ep, first = self.ep
        t, h, per = flat.shape[0], flat.shape[1], self.n // ep
        chosen = torch.zeros(t, self.n, dtype=flat.dtype, device=flat.device).scatter(1, experts, 1.0)
        scale = torch.zeros(t, self.n, dtype=flat.dtype, device=flat.device).scatter(1, experts, weights)
        rank, token = chosen.view(t, ep, per).amax(-1).T.nonzero(as_tuple=True)  # by destination rank
        send = torch.bincount(rank, minlength=ep)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        send_n, recv_n = send.tolist(), recv.tolist()
        payload = torch.cat([flat[token], scale.view(t, ep, per)[token, rank], chosen.view(t, ep, per)[token, rank]], 1)
        got = all_to_all_single(flat.new_empty(sum(recv_n), h + 2 * per), payload, recv_n, send_n, group)
        x, w, mine = got.split([h, per, per], dim=1)
        expert, row = mine.T.nonzero(as_tuple=True)  # the rows received for each of my experts, in turn
        runs = x[row].split(torch.bincount(expert, minlength=per).tolist())  # one gather: one backward scatter
        out = torch.cat([self.experts[str(first + j)](r, 1.0 / ep) for j, r in enumerate(runs)])
        summed = torch.zeros_like(x).index_add_(0, row, out * w[row, expert].unsqueeze(-1))
        back = all_to_all_single(flat.new_empty(len(token), h), summed, send_n, recv_n, group)
        return torch.zeros_like(flat).index_add_(0, token, back)


def apply_expert_parallel(chunk, mesh, plan_mesh):
    """Under expert parallelism (plan_mesh.ep > 1; runtime.parallelize.build_mesh's "ep" and "edp"
    dimensions) keep in each MoE block of `chunk` (on meta, before TP and FSDP) the experts of
    this rank of the EP group: experts / ep consecutive ones, by their global index (their names
    and initial values stay those of a run without it). Returns the mesh FSDP2 shards the experts
    over (the dp / ep ranks holding the same ones, times the CP ranks under context parallelism:
    build_mesh's "edp_cp"; under HSDP, of the replica, and the replicas outside), None without
    expert parallelism."""
    if plan_mesh.ep == 1:
        return None
    ep_mesh = mesh["ep"]
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    for module in chunk.modules():
        if isinstance(module, MoEFeedForward):
            per = module.n // ep
            for j in list(module.experts.keys()):
                if not rank * per <= int(j) < (rank + 1) * per:
                    del module.experts[j]
            module.ep = (ep_mesh.get_group(), ep, rank * per)
    from runtime.parallelize import mesh_slice
    replicas = ("dp_replicate",) if plan_mesh.dp_replicate > 1 else ()
    return mesh_slice(mesh, *replicas, "edp_cp" if plan_mesh.cp > 1 else "edp")


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


def attach_routing(chunks, plan, scaler, tp_rank: int, context, device) -> "RoutingMeter":
    """Each MoE block of the chunks records its routing for the step's figures (RoutingMeter) and,
    with training.moe_aux_loss, adds that times its load-balancing loss (module doc), scaled as the
    main loss: by `scaler`'s loss scale (runtime.loss_scale), 1 / micro-batches without a pipeline
    schedule (runtime.train._accumulate divides the loss), 1 / tp. Under context parallelism
    (`context`, runtime.context_parallel.ContextParallel, else None) the shares f_i are the whole
    sequence's (module doc). A dense model's meter records nothing."""
    alpha = plan.training.moe_aux_loss
    per = alpha / plan.mesh.tp / (1 if plan.mesh.pp > 1 else plan.pipeline.micro_batches)
    modules = [module for chunk in chunks for module in chunk.modules() if isinstance(module, MoEFeedForward)]
    for module in modules:
        module.loads = []
        if alpha:
            module.aux_scale = lambda: per * scaler.scale
            module.cp = None if context is None else (context.group, plan.mesh.cp)
    return RoutingMeter(modules, plan, tp_rank, device)


class RoutingMeter:
    """A step's routing figures, each read by an all-reduce over the world (every rank calls read):
    - moe_balance, the load-balancing loss (Megatron-LM logs it as load_balancing_loss): (n / k)
      sum_i f_i P_i, not times alpha, averaged over the model's MoE blocks, the micro-batches and
      the data-parallel (and CP) ranks, each TP group counted once; 1 where the routing is uniform,
      n / k where every token goes to the same experts; None without the loss;
    - moe_load_factor, what training.moe_load_factor prices: each block forward's busiest expert's
      rows over the mean, counted over the tokens an EP group routes together (one rank's
      micro-batch without expert parallelism: a larger EP group evens its load out more), averaged
      over the step's forwards (a full recomputation's replays count again, alike) and ranks;
    - moe_rank_load_factor, under expert parallelism: the same of the EP group's busiest rank (the
      rows of its experts together), what paces the group (planner.moe.expert_load prices it)."""

    def __init__(self, modules: list, plan, tp_rank: int, device):
        self.modules, self.owner, self.device = modules, tp_rank == 0, device
        self.count = plan.model.layers * plan.pipeline.micro_batches * plan.mesh.grad_ranks
        self.moe, self.aux = plan.model.moe is not None, plan.training.moe_aux_loss > 0
        self.ep = plan.mesh.ep
        self.balances, self.loads, self.rank_loads = [], [], []

    def read(self) -> None:
        """Adds the step's figures to self.balances and self.loads (nothing for a dense model); the
        forwards' records cleared."""
        if not self.moe:
            return
        seen = [a for m in self.modules for a in m.aux_seen]
        counts = [c for m in self.modules for c in m.loads]
        for m in self.modules:
            m.aux_seen.clear()
            m.loads.clear()
        # balance sum, expert load sum, rank load sum, forwards
        total = torch.zeros(4, dtype=torch.float64, device=self.device)
        if seen and self.owner:
            total[0] += torch.stack(seen).double().sum()
        if counts:
            rows = torch.stack(counts).double()  # [forwards, experts]
            if self.ep > 1:  # the EP group's tokens (the same forwards on each of its ranks)
                dist.all_reduce(rows, group=self.modules[0].ep[0])
            ranks = rows.view(len(counts), self.ep, -1).sum(-1)  # a rank's experts: consecutive ones
            total[1] += (rows.amax(1) / rows.mean(1)).sum()
            total[2] += (ranks.amax(1) / ranks.mean(1)).sum()
            total[3] += len(counts)
        dist.all_reduce(total)
        if self.aux:
            self.balances.append(float(total[0]) / self.count)
        self.loads.append(float(total[1] / total[3]) if total[3] else None)
        self.rank_loads.append(float(total[2] / total[3]) if total[3] else None)

    def record(self) -> dict:
        """run.json's moe_balance, moe_load_factor and moe_rank_load_factor, a figure a step each (None
        where not measured)."""
        return {"moe_balance": self.balances or None, "moe_load_factor": self.loads if self.moe else None,
                "moe_rank_load_factor": self.rank_loads if self.moe and self.ep > 1 else None}
