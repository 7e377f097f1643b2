"""What the runtime's FSDP2 holds on a device beside the ZeRO paper's accounting of parameters,
gradients and optimizer state: its groups (each block, the embedding and the head apart, a tied
pair in the root's group; runtime.parallelize.apply_data_parallel), the gathered parameters and
the reduce-scatter inputs of each ZeRO level. planner.memory adds them to a rank's peak."""
from __future__ import annotations


def grads_sharded(zero: int, micro_batches: int) -> bool:
    """Whether a stage holds its gradients sharded over data parallelism between micro-batches:
    ZeRO 2 and 3 reduce-scatter every micro-batch's (the ZeRO paper's P_os+g and P_os+g+p);
    ZeRO 1 accumulates them unsharded and reduces once, after the last."""
    return zero >= 2


def zero_state_bytes(zero: int, dp: int, micro_batches: int, pb: float, gb: float, ob: float,
                     spb: float) -> tuple[float, float, float]:
    """(parameter, gradient, optimizer-state) bytes per parameter a device holds at a ZeRO level:
    the ZeRO paper's partitioning of optimizer states (1+), gradients (grads_sharded) and
    parameters (3: FSDP2's shard, spb bytes each; planner.precision)."""
    shard = dp if dp > 1 else 1
    return (spb / shard if zero == 3 and shard > 1 else pb,
            gb / (shard if grads_sharded(zero, micro_batches) else 1),
            ob / (shard if zero >= 1 else 1))


def fsdp_extra_bytes(zero: int, dp: int, micro_batches: int, block_params: list, root_params: float,
                     pb: float, gb: float, shard_pb: float | None = None, split: bool = False,
                     rs_temp: bool = False, own: tuple = (0.0, 0.0)) -> float:
    """Bytes the runtime's ZeRO holds for one stage beyond the ZeRO paper's accounting: the sum of
    fsdp_extra_parts."""
    return sum(fsdp_extra_parts(zero, dp, micro_batches, block_params, root_params, pb, gb, shard_pb, split,
                                rs_temp, own))


def fsdp_groups(tie_embeddings: bool, embedding: float | None, head: float | None) -> tuple[float, tuple]:
    """(root, (embedding, head)): the parameters of a stage's FSDP2 root group and of the
    embedding's and the head's own groups (runtime.parallelize.apply_data_parallel), from the
    parameters of the stage's embedding and head (None where it holds none). A tied embedding and
    head share the root's group; otherwise each has its own and the root holds nothing."""
    if tie_embeddings and embedding is not None and head is not None:
        return embedding + head, (0.0, 0.0)
    return 0.0, (embedding or 0.0, head or 0.0)


def fsdp_extra_parts(zero: int, dp: int, micro_batches: int, block_params: list, root_params: float,
                     pb: float, gb: float, shard_pb: float | None = None,
                     split: bool = False, rs_temp: bool = False, own: tuple = (0.0, 0.0)) -> tuple[float, float]:
    """(held, transient): bytes the runtime's ZeRO (FSDP2 fully_shard per block, on the embedding
    and on the head, and on the stage's root module) holds beyond the ZeRO paper's accounting of one stage, per device; `held` all step, `transient`
    only while the stage computes, so a rank with several stages (interleaved) holds the held
    bytes of each and the transient bytes of one. `root_params` are those of the root's group,
    `own` the (embedding, head) parameters in groups of their own (fsdp_groups): the embedding's
    is a group like a block's, resharded after forward under ZeRO 3 and reduced last; the head's,
    not resharded after forward, is held as the root's is, and reduced first. Replicate (ZeRO 0)
    takes the chunk as one.
    ZeRO 1/2 (not resharded after forward): held, the sharded parameters besides the unsharded
    ones (shard_pb bytes each, default pb; none under mixed precision, where the shard is the
    float32 master copy the optimizer state counts); transient, the flat reduce-scatter input of
    one group's gradients (ZeRO 0, FSDP2's replicate, all-reduces the same flat input); under
    ZeRO 2 with several micro-batches, a group's gradients and input beside the previous group's
    input. ZeRO 3: held, the root's and the head's groups unsharded (FSDP2 does not reshard the
    root after forward; the runtime keeps the head's to its backward); transient, the root's
    unsharded gradients from the head's backward to the end of the backward (its post-backward
    runs last), the two largest blocks (or the embedding) unsharded at once (current and
    prefetched), the gather of the next one in flight (its all-gather input, the shard, and flat
    output, which FSDP2 copies out into the unsharded parameters before freeing it: torch/
    distributed/fsdp/_fully_shard/_fsdp_collectives.py, foreach_all_gather and
    foreach_all_gather_copy_out), and one reduce-scatter input. ZeRO 2/3 with several micro-batches reduce-scatter in every backward,
    and FSDP2 keeps the last input of each until the next: held by every stage of a rank.
    Under a split backward (`split`: zbv's I and W, runtime.pipeline) ZeRO 2 and 3 compute a
    chunk's weight gradients at once (W) before reduce-scattering them group by group: the whole
    chunk's unsharded gradients beside one group's flat input; ZeRO 3 also gathers the whole
    chunk's blocks and embedding for I and for W (torch differentiates with respect to the
    parameters the module holds then), with one block's gather in flight.
    `rs_temp`: the collectives' library takes a temporary as large as a reduce-scatter's input
    while it runs (gloo: measured here, a 16.8 MB reduce_scatter_single peaked 16.8 MB above its
    buffers, an all-reduce or all-gather of that size 0.005 MB; NCCL reduces in place): one more
    largest group's gradients in the transient of ZeRO 1-3.
    Measured on CPU against run.json peaks (benchmarks/prediction_accuracy.py;
    tests/test_runtime.py: fp32, bf16, pipelines, interleaved)."""
    emb, head = own
    if zero == 0:  # replicate: the chunk is one group
        root_params, emb, head = root_params + emb + head, 0.0, 0.0
    held, transient = _fsdp_extra(zero, dp, micro_batches, block_params, root_params, pb, gb, shard_pb, emb, head)
    group = max(list(block_params) + [root_params, emb, head])  # the largest reduce-scatter's parameters
    if split and zero >= 2 and dp > 1:
        transient = (sum(block_params) + root_params + emb + head + group) * gb
        if zero == 3:
            transient += (sum(block_params) + emb + max(list(block_params) + [emb], default=0.0) / dp) * pb
    if rs_temp and zero >= 1 and dp > 1:
        transient += group * gb
    if zero >= 2 and dp > 1 and (micro_batches > 1 or split):
        # FSDP2 keeps the last reduce-scatter input of a backward until the stage's next backward
        # starts reducing: in backward order the root's, else the embedding's, else the first
        # block's, else the head's; under a split backward, whose W reduces the groups in module
        # order (runtime.pipeline), the head's, else the last block's, else the embedding's or the
        # root's. A rank's other stages (interleaved) hold theirs while one computes.
        last = ((head or (block_params[-1] if block_params else emb or root_params)) if split
                else (root_params or emb or (block_params[0] if block_params else head)))
        retained = last * gb
        return held + retained, transient - retained
    return held, transient


def _fsdp_extra(zero, dp, micro_batches, block_params, root_params, pb, gb, shard_pb, emb, head):
    if dp <= 1:
        return 0.0, 0.0
    group = max(list(block_params) + [root_params, emb, head])
    if zero == 0:
        return 0.0, group * gb
    if zero in (1, 2):
        rs = group * gb
        if zero == 2 and micro_batches > 1:
            # ZeRO 2 reduce-scatters during every backward: a group's unsharded gradients and their
            # flat input, beside the previous group's input, which FSDP2 keeps until the next
            # reduce-scatter starts (FSDPCommContext.reduce_scatter_states, at most one; torch
            # _fsdp_param_group.py post_backward). Groups reduce in backward order: the head, the
            # blocks last to first, the embedding, then the root (its post-backward waits for the
            # embedding's gradient); each term bounds one pair, any block standing for the largest.
            big, second = (sorted(block_params, reverse=True) + [0.0, 0.0])[:2]
            rs = max(2 * head, max(head, second) + 2 * big if big else 0.0, (big or head) + 2 * emb,
                     max(big, emb, head) + 2 * root_params) * gb
        return (sum(block_params) + root_params + emb + head) * (pb if shard_pb is None else shard_pb) / dp, rs
    ordered = sorted(list(block_params) + ([emb] if emb else []), reverse=True) or [0.0]
    gather = ordered[0] * (1 + 1 / dp)
    # held: the groups not resharded after forward; the root's gradients wait for the embedding's
    return (root_params + head) * pb, (sum(ordered[:2]) + gather) * pb + (root_params + group) * gb
