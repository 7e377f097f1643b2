"""Apply a plan stage's parallelism to a model chunk, in torchtitan's order: TP, recompute, FSDP.

Every function takes a plain `Transformer` chunk (runtime.model) and changes it in place:
- apply_tp: DTensor tensor parallelism (Megatron-style column/row splits, Shoeybi et al. 2019)
  with optional sequence parallelism (Korthikanti et al. 2022) through `parallelize_module`;
  the embedding by rows with RowShardedEmbedding.
- apply_recompute: per-layer activation checkpointing, "full" (whole block) or "selective"
  (the attention core only).
- apply_data_parallel: FSDP2 `fully_shard` for ZeRO 1-3, torch's composable `replicate` (FSDP2
  machinery, replicated placement) for ZeRO 0; both keep every parameter a DTensor. Under a
  16-bit compute dtype both gather and compute with 16-bit parameters and reduce gradients in
  float32 (MixedPrecisionPolicy, as torchtitan does): the float32 parameters they keep are the
  master copy the plan's mixed precision counts, the 16-bit ones its working parameters.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from planner.model import ConfigError
from runtime.model import Block, Embedding, Head, Transformer
from runtime.moe import MoEFeedForward, MoETensorParallel
from runtime.sp_shard import keep_shards as keep_shards_of

# FSDP2 warns when a wrapped chunk returns a view (under TP the head returns its local slice of the
# logits, a view of the DTensor's): nothing here modifies a chunk's output in place.
warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")


class ReplicateParallel(ParallelStyle):
    """Parameters held whole on every TP rank, but as Replicate DTensors so that a chunk never
    mixes DTensor and plain parameters (foreach AdamW and norm clipping need one kind). Input and
    output stay local tensors; the input is the same on every rank of the TP group."""
    input_placement: Placement = Replicate()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(name, mod, mesh):
            for pname, p in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(pname, nn.Parameter(distribute_tensor(p, mesh, [Replicate()])))

        def to_dtensor(mod, inputs, mesh):
            return tuple(DTensor.from_local(x, mesh, [self.input_placement], run_check=False)
                         if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in inputs)

        def to_local(mod, out, mesh):
            return out.to_local() if isinstance(out, DTensor) else out

        return distribute_module(module, device_mesh, partition, to_dtensor, to_local)


class HeadShardedNorm(ReplicateParallel):
    """A norm of each attention head (Qwen3's q and k norms): its weight held whole as a Replicate
    DTensor, its input this rank's heads [b, s, heads / tp, head_dim] declared Shard(2), so that
    DTensor makes the weight's gradient a partial sum over the TP group (made whole by FSDP2 or
    runtime.optim.reduce_partial_grads, as sequence parallelism's norms); the output local."""
    input_placement = Shard(2)


class _RowShardedEmbedding(nn.Embedding):
    """An nn.Embedding whose weight is a DTensor split by rows over a TP mesh (RowShardedEmbedding)."""
    output_layout: Placement

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mesh = self.weight.device_mesh
        rows = self.weight.to_local()  # its backward makes the gradient a Shard(0) DTensor of these rows
        chunk = -(-self.num_embeddings // mesh.size())  # DTensor's Shard(0) split: torch.chunk's
        local = ids - min(mesh.get_local_rank() * chunk, self.num_embeddings)
        outside = (local < 0) | (local >= rows.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), rows).masked_fill(outside.unsqueeze(-1), 0.0)
        partial = DTensor.from_local(out, mesh, [Partial()], run_check=False)
        return partial.redistribute(mesh, [self.output_layout]).to_local()


class RowShardedEmbedding(ParallelStyle):
    """An embedding split by rows (the vocabulary; GPT's positions) over the TP mesh, the scheme of
    Megatron-LM's VocabParallelEmbedding (Shoeybi et al. 2019): each rank looks the ids up in its
    rows, zeroes the others, and DTensor's redistribute sums the ranks' parts (an all-reduce to a
    replicated output, a reduce-scatter to sequence shards under SP). The input ids are a local
    tensor, the same on every rank; the output a local tensor of `output_layout`.
    It replaces RowwiseParallel on nn.Embedding, with which DTensor (torch 2.13) computes the
    embedding's backward with the whole table's gradient on every rank (embedding_dense_backward
    has no row-sharded strategy): a vocab x hidden gradient held per rank where the plan counts
    vocab / tp rows of it."""

    def __init__(self, output_layout: Placement):
        super().__init__()
        self.output_layout = output_layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if type(module) is not nn.Embedding:
            raise TypeError(f"RowShardedEmbedding applies to nn.Embedding, not {type(module).__name__}")

        def partition(name, mod, mesh):
            mod.register_parameter("weight", nn.Parameter(distribute_tensor(mod.weight, mesh, [Shard(0)])))

        distribute_module(module, device_mesh, partition)
        module.__class__ = _RowShardedEmbedding
        module.output_layout = self.output_layout
        return module


def _block_plan(sequence_parallel: bool, qk_norm: bool = False) -> dict[str, ParallelStyle]:
    seq = Shard(1) if sequence_parallel else Replicate()
    norm = SequenceParallel() if sequence_parallel else ReplicateParallel()
    heads = {"attention.q_norm": HeadShardedNorm(), "attention.k_norm": HeadShardedNorm()} if qk_norm else {}
    return {**heads,
        "attention_norm": norm,
        "attention": PrepareModuleInput(input_layouts=(seq, None, None),
                                        desired_input_layouts=(Replicate(), None, None)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=seq),
        "ffn_norm": norm,
        "feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=seq),
        "feed_forward.w3": ColwiseParallel(),
    }


def apply_tp(chunk: Transformer, tp_mesh: DeviceMesh, sequence_parallel: bool, keep_shards: bool = True) -> None:
    """Shard the chunk's layers over `tp_mesh`. The embedding is split by vocabulary rows
    (RowShardedEmbedding), the head by vocabulary columns (ColwiseParallel): it returns this rank's
    vocabulary slice of the logits as a local tensor, for runtime.loss's vocab-parallel loss.
    Between layers the hidden state is a local tensor, sequence-sharded under SP. With
    `keep_shards` (training.sp_saved_inputs "shard") the inputs SP gathers for the column-parallel
    linears are kept as shards for the backward (runtime.sp_shard), except in blocks recomputed in
    full or per op (whose checkpoint keeps none of them)."""
    seq = Shard(1) if sequence_parallel else Replicate()
    for layer in chunk.layers.values():
        if isinstance(layer, Embedding):
            plan = {"tok_embeddings": RowShardedEmbedding(seq)}
            if layer.pos_embeddings is not None:
                plan["pos_embeddings"] = RowShardedEmbedding(seq)
        elif isinstance(layer, Head):
            plan = {
                "norm": SequenceParallel() if sequence_parallel else ReplicateParallel(),
                "output": ColwiseParallel(input_layouts=seq,
                                          output_layouts=Shard(-1), use_local_output=True),
            }
        else:
            plan = _block_plan(sequence_parallel, chunk.cfg.qk_norm)
            if isinstance(layer.feed_forward, MoEFeedForward):  # runtime.moe: experts split alike
                plan = {k: v for k, v in plan.items() if not k.startswith("feed_forward")}
                plan["feed_forward"] = MoETensorParallel(sequence_parallel)
            elif not layer.feed_forward.gated:
                del plan["feed_forward.w3"]
        parallelize_module(layer, tp_mesh, plan)
        if sequence_parallel and keep_shards:
            if isinstance(layer, Head):
                keep_shards_of(layer.output, tp_mesh, lambda: True)
            elif isinstance(layer, Block):
                for module in (layer.attention, layer.feed_forward)[:1 if isinstance(layer.feed_forward, MoEFeedForward) else 2]:
                    keep_shards_of(module, tp_mesh, lambda layer=layer: not (layer.full_recompute or layer.per_op))
    retie(chunk)


def holds_tied_pair(chunk: Transformer) -> bool:
    """Whether the chunk holds both a tied embedding and the head that shares its matrix."""
    return chunk.cfg.tie_embeddings and "0" in chunk.layers and str(chunk.cfg.layers + 1) in chunk.layers


def retie(chunk: Transformer) -> None:
    """Tied embeddings: make the head's projection the embedding's weight again (TP and
    materialization replace parameter objects)."""
    if holds_tied_pair(chunk):
        head, emb = chunk.layers[str(chunk.cfg.layers + 1)].output, chunk.layers["0"].tok_embeddings
        if head.weight is not emb.weight:
            head.weight = emb.weight


def apply_recompute(chunk: Transformer, modes: dict[int, str], split_backward: bool = False,
                    per_op: bool = False) -> None:
    """`modes` maps a layer index to none | selective | full (the plan stage's recompute list);
    `per_op`: "selective" is torchtitan's per-op policy (training.selective_recompute "ops", planner.sac:
    the block checkpointed with runtime.recompute.per_op_contexts), else the attention core alone.
    Under a split backward (zbv's I and W) a fully recomputed block replays once for both
    (runtime.recompute); a selective one's attention core is read by I alone, which torch's
    checkpoint replays once and frees at once."""
    for name, layer in chunk.layers.items():
        mode = modes.get(int(name), "none")
        if isinstance(layer, Block):
            layer.full_recompute = mode == "full"
            layer.per_op = per_op and mode == "selective"  # training.selective_recompute "ops" (planner.sac)
            layer.attention.selective_recompute = mode == "selective" and not per_op
            layer.replay_once = split_backward
        elif mode != "none":
            raise ConfigError(f"recompute: layer {name} is not a block; only blocks are recomputed")


def apply_data_parallel(chunk: Transformer, dp_mesh: DeviceMesh, zero: int,
                        param_dtype: torch.dtype | None = None, expert_mesh: DeviceMesh | None = None) -> None:
    """ZeRO 3: FSDP2 per block, parameters resharded after forward; the embedding and the head
    (final norm and output projection) in groups of their own, as torchtitan wraps them, the
    head's kept gathered from its forward to its backward, which follows at once; then the chunk
    (the root, FSDP2's step-level state). A tied embedding and head share one matrix, so where the
    chunk holds both they stay in the root's group. In the root's group the embedding and head
    would be gathered all step (FSDP2 does not reshard the root after forward) and their
    gradients kept unsharded from the head's backward to the embedding's, at the end of the
    backward: on Llama 3 8B (1.05B parameters in the two matrices) 2.1 GB a GPU in bf16, the
    weights and their gradients each.
    ZeRO 1 and 2: the same groups without resharding after forward (FSDP2 always shards gradients
    and optimizer state, so they hold less than a ZeRO-1/2 plan counts, never more). ZeRO 0:
    `replicate` (all-reduced gradients, everything replicated). Nothing to do when dp == 1. Under
    expert parallelism (`expert_mesh`: runtime.moe.apply_expert_parallel) each MoE block's experts
    are a group of their own over that mesh, inside their block's."""
    if dp_mesh.size() == 1:
        return
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    if zero == 0:
        from torch.distributed._composable.replicate_with_fsdp import replicate
        replicate(chunk, mesh=dp_mesh, mp_policy=mp)
        return
    reshard = zero == 3
    tied = holds_tied_pair(chunk)
    for layer in chunk.layers.values():
        if expert_mesh is not None and isinstance(layer, Block) and isinstance(layer.feed_forward, MoEFeedForward):
            fully_shard(list(layer.feed_forward.experts.values()), mesh=expert_mesh, reshard_after_forward=reshard,
                        mp_policy=mp)
        if isinstance(layer, Block) or (isinstance(layer, Embedding) and not tied):
            fully_shard(layer, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp)
        elif isinstance(layer, Head) and not tied:
            fully_shard(layer, mesh=dp_mesh, reshard_after_forward=False, mp_policy=mp)
    fully_shard(chunk, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp)


def mesh_slice(mesh: DeviceMesh, *names: str) -> DeviceMesh:
    """mesh[names], flattened dimensions among them, without torch 2.13's warning that slicing one
    will change."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return mesh[names if len(names) > 1 else names[0]]


def build_mesh(m, device_type: str) -> tuple[DeviceMesh, DeviceMesh]:
    """The world's DeviceMesh in the plan's order, and the mesh data parallelism runs over. Under
    HSDP (mesh.dp_replicate > 1) dp is two dimensions, dp_replicate outside dp_shard, as
    planner.plan.Mesh numbers them, and FSDP2 takes both (replicas x shards). Under expert
    parallelism the shard dimension is two, "edp" outside "ep" (the ep consecutive ranks of an EP
    group inside, the ones holding the same experts outside: runtime.moe.apply_expert_parallel)."""
    shard = ("edp", "ep") if m.ep > 1 else ("dp_shard",) if m.dp_replicate > 1 else ("dp",)
    split = (("dp_replicate",) if m.dp_replicate > 1 else ()) + shard
    dims = [d for dim in m.order for d in (split if dim == "dp" else (dim,))]
    sizes = {"pp": m.pp, "dp": m.dp, "cp": m.cp, "tp": m.tp, "dp_replicate": m.dp_replicate, "dp_shard": m.dp_shard,
             "edp": m.dp_shard // m.ep, "ep": m.ep}
    mesh = DeviceMesh(device_type, torch.arange(m.world_size).reshape([sizes[d] for d in dims]),
                      mesh_dim_names=tuple(dims))
    # context parallelism: the CP ranks hold the same parameters, so ZeRO shards over dp (HSDP's
    # shard group) x cp and gradients add up over them too (torchtitan's dp_shard_cp)
    if m.ep > 1:
        if m.cp > 1:  # the ranks holding the same experts
            mesh["edp", "cp"]._flatten("edp_cp")
        name = ("dp_shard" if m.dp_replicate > 1 else "dp") + ("_cp" if m.cp > 1 else "")
        flat = mesh[("edp", "ep", "cp") if m.cp > 1 else ("edp", "ep")]._flatten(name)
        return mesh, flat if m.dp_replicate == 1 else mesh_slice(mesh, "dp_replicate", name)
    if m.cp == 1:
        return mesh, mesh["dp_replicate", "dp_shard"] if m.dp_replicate > 1 else mesh["dp"]
    if m.dp_replicate == 1:
        return mesh, mesh["dp", "cp"]._flatten("dp_cp")
    mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    return mesh, mesh_slice(mesh, "dp_replicate", "dp_shard_cp")
