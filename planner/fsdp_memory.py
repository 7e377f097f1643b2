"""What the runtime's FSDP2 holds on a device beside the ZeRO paper's accounting of parameters,
gradients and optimizer state: its groups (each block, the embedding and the head apart, a tied
pair in the root's group; runtime.parallelize.apply_data_parallel), the gathered parameters and
the reduce-scatter inputs of each ZeRO level. planner.memory adds them to a rank's peak."""
from __future__ import annotations


def grads_sharded(zero: int, micro_batches: int, defer: bool = False) -> bool:
    """Whether a stage holds its gradients sharded over data parallelism between micro-batches:
    ZeRO 2 and 3 reduce-scatter every micro-batch's (the ZeRO paper's P_os+g and P_os+g+p);
    ZeRO 1 accumulates them unsharded and reduces once, after the last, as ZeRO 2 and 3 do where
    the sync is deferred (`defer`: training.defer_grad_sync, with more than one micro-batch)."""
    return zero >= 2 and not (defer and micro_batches > 1)


def zero_state_bytes(zero: int, dp: int, micro_batches: int, pb: float, gb: float, ob: float,
                     spb: float, fsdp: bool = False, defer: bool = False,
                     deferred_gb: float | None = None) -> tuple[float, float, float]:
    """(parameter, gradient, optimizer-state) bytes per parameter a device holds at a ZeRO level:
    the ZeRO paper's partitioning of optimizer states (1+), gradients (grads_sharded) and
    parameters (3: FSDP2's shard, spb bytes each; planner.precision). `fsdp`: FSDP2 shards them
    even over one rank (an expert-parallel group holding all the dp ranks: runtime.moe), keeping
    its shard and gathering the working copy for the layer alone, as over several. ZeRO 2 and 3
    deferring their sync (`defer`) hold their gradients unsharded, `deferred_gb` bytes each
    (planner.precision.deferred_grad_bytes; gb where not given)."""
    shard = dp if dp > 1 else 1
    deferred = zero >= 2 and (shard > 1 or fsdp) and not grads_sharded(zero, micro_batches, defer)
    return (spb / shard if zero == 3 and (shard > 1 or fsdp) else pb,
            (deferred_gb or gb) if deferred else gb / (shard if zero >= 2 else 1),
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
                     pb: float, gb: float, shard_pb: float | None = None, split: bool = False,
                     rs_temp: bool = False, own: tuple = (0.0, 0.0), head_held: bool = False,
                     resharded: bool = False, defer: bool = False) -> tuple[float, float]:
    """(held, transient): bytes the runtime's ZeRO (FSDP2 fully_shard per block, on the embedding
    and on the head, and on the stage's root module) holds beyond the ZeRO paper's accounting of
    one stage, per device; `held` all step, `transient` only while the stage computes, so a rank
    with several stages (interleaved) holds the held bytes of each and the transient bytes of one.
    `root_params` are those of the root's group, `own` the (embedding, head) parameters in groups
    of their own (fsdp_groups): the embedding's is a group like a block's, resharded after forward
    under ZeRO 3 and reduced last; the head's, not resharded after forward (the runtime keeps it to
    its backward), is reduced first. Replicate (ZeRO 0) takes the chunk as one.
    ZeRO 0 and 1: transient, the flat all-reduce or reduce-scatter input of one group's gradients;
    ZeRO 1-2 (not resharded after forward) hold the sharded parameters besides the unsharded ones
    (shard_pb bytes each, default pb; none under mixed precision, where the shard is the float32
    master copy the optimizer state counts). ZeRO 3 holds the root's group unsharded (FSDP2 does
    not reshard the root after forward), and the head's where the rank holds several stages
    (`head_held`: between the head's forward and its backward the others compute); with one stage a
    rank the head's backward is a moment of its own. ZeRO 2 and 3 reduce-scatter in every
    backward, group by group: their transient is the backward's worst moment (backward_moments).
    ZeRO 2/3 with several micro-batches keep the last input of each backward until the next: held
    by every stage of a rank. Deferring the sync (`defer`, training.defer_grad_sync) makes ZeRO 2
    ZeRO 1; ZeRO 3 then reduce-scatters in its last backward alone, which keeps nothing after it.
    Under a split backward (`split`: zbv's I and W, runtime.pipeline) ZeRO 2 and 3 compute a
    chunk's weight gradients at once (W) before reduce-scattering them group by group: the whole
    chunk's unsharded gradients beside one group's flat input; ZeRO 3 also gathers the whole
    chunk's blocks and embedding for I and for W (torch differentiates with respect to the
    parameters the module holds then), with one block's gather in flight.
    `rs_temp`: the collectives' library takes a temporary as large as a collective's output while
    it runs (gloo: measured here, a 16.8 MB reduce_scatter_single peaked 16.8 MB above its buffers,
    and FSDP2's all-gather of a 12 MiB block 12 MiB above its output; NCCL works in place): one
    more largest group's gradients in the transient of ZeRO 1 and of split backwards, and in
    backward_moments where each collective runs.
    Measured on CPU against run.json peaks (benchmarks/zero_memory.py,
    benchmarks/prediction_accuracy.py; tests/test_runtime.py: fp32, bf16, pipelines, interleaved)."""
    emb, head = own
    if zero == 2 and not grads_sharded(zero, micro_batches, defer):
        zero = 1  # ZeRO 2 deferring its sync is ZeRO 1 (its parameters stay gathered either way)
    if zero == 0:  # replicate: the chunk is one group
        root_params, emb, head = root_params + emb + head, 0.0, 0.0
    blocks = list(block_params)
    group = max(blocks + [root_params, emb, head])  # the largest reduce-scatter's parameters
    # the last reduce-scatter input of a backward, which FSDP2 keeps until the stage's next
    # backward starts reducing: in backward order the root's, else the embedding's, else the first
    # block's, else the head's; under a split backward, whose W reduces the groups in module order
    # (runtime.pipeline), the head's, else the last block's, else the embedding's or the root's
    last = ((head or (blocks[-1] if blocks else emb or root_params)) if split
            else (root_params or emb or (blocks[0] if blocks else head)))
    retains = zero >= 2 and dp > 1 and (micro_batches > 1 or split) and grads_sharded(zero, micro_batches, defer)
    held, transient = _fsdp_extra(zero, dp, blocks, root_params, pb, gb, shard_pb, emb, head,
                                  head_held or split)
    if split and zero >= 2 and dp > 1:
        transient = (sum(blocks) + root_params + emb + head + group) * gb
        if zero == 3:
            transient += (sum(blocks) + emb + max(blocks + [emb], default=0.0) / dp) * pb
    if rs_temp and dp > 1 and (zero == 1 or (split and zero >= 2)):
        transient += group * gb
    if zero >= 2 and dp > 1 and not split:
        transient += backward_moments(zero, dp, blocks, root_params, emb, head, pb, gb,
                                      last if retains else 0.0, rs_temp, head_held, resharded)
    if retains:
        # a rank's other stages (interleaved) hold theirs while one computes; the stage's own
        # backward frees it when it starts reducing (in its transient until then)
        retained = last * gb
        return held + retained, transient - retained
    return held, transient


def forward_loss_bytes(zero: int, dp: int, head: float, pb: float, head_held: bool) -> float:
    """What FSDP2 holds beyond the ZeRO paper's accounting and `fsdp_extra_parts`' held bytes
    while the stage holding the head runs the head's forward and the loss (runtime.train computes
    the loss after the model's forward, runtime/loss.py): under ZeRO 3 the head's gathered
    parameters (not resharded after forward; held all step where `head_held`) and, through the
    head's product, its flat all-gather output, which FSDP2 frees at the root's post-forward
    (_fsdp_state.py). `head`: the parameters of the head's own group (fsdp_groups; a tied head is
    the root's, held). Nothing under ZeRO 0-2, whose parameters stay gathered in forward."""
    if zero != 3 or dp <= 1:
        return 0.0
    return head * pb * (1.0 if head_held else 2.0)


def backward_moments(zero: int, dp: int, blocks: list, root: float, emb: float, head: float, pb: float,
                     gb: float, before: float, temp: bool, head_held: bool, resharded: bool = False) -> float:
    """The most ZeRO 2 and 3 hold beyond the ZeRO paper's accounting at one moment of a stage's
    backward, as FSDP2 runs it (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py:
    pre_backward unshards a group, copies its gathered parameters out, frees the flat all-gather
    output and prefetches the next group's; post_backward reshards the group, drops the previous
    group's reduce-scatter input and reduces its gradients through a flat input of their own,
    which it keeps until the next group reduces). Groups run their backward head, blocks last to
    first, embedding, root. While group X computes: its unsharded parameters (ZeRO 3; the head's
    are held where `head_held`), the previous group's reduce-scatter input (`before`, the last
    backward's last input, for the first group), the next group's gather in flight (ZeRO 3: its
    flat output, whose input is a view of it) and X's gradients as autograd makes them (in the
    parameters' dtype, pb bytes each), or gloo's temporary of the gather (`temp`). While X reduces:
    the gather still in flight, X's gradients, their flat input and sharded output (in the
    gradients' dtype, gb bytes each: float32 under mixed precision, MixedPrecisionPolicy
    reduce_dtype) and gloo's temporary of the input (`temp`). The root's group (a tied embedding
    and head) reduces last; until the embedding's backward autograd holds the tied matrix's
    gradient from the head's (planner.memory.tied_matrix_grad_bytes, counted there). `blocks`: the
    stage's blocks' parameters in layer order. Heap-traced on CPU (docs/HISTORY.md, session 42).
    `resharded`: the runtime reshards each ZeRO 1/2 group after the step's last backward
    (runtime.train; not in a pipeline, runtime.pipeline), so with one micro-batch a ZeRO 2 group's
    gathered parameters (in the ZeRO paper's count) are gone before it reduces; the groups
    reduced before it are too, not counted (an over-prediction)."""
    t = 1.0 if temp else 0.0
    n, gathers, kept = len(blocks), zero == 3, 0.0 if zero == 2 and resharded else 1.0
    # (group, its parameters gathered, the input reduced before it, the group prefetched beside
    # it), in backward order; blocks alike give few distinct rows
    rows = {(head, 0.0 if head_held else head, before, blocks[-1] if n else emb)}
    rows |= {(blocks[j], blocks[j], blocks[j + 1] if j + 1 < n else head or before, blocks[j - 1] if j else emb)
             for j in range(n)}
    rows.add((emb, emb, blocks[0] if n else head or before, 0.0))
    most = max([(own + nxt) * gathers * pb + r * gb + max(x, nxt * gathers * t) * pb for x, own, r, nxt in rows if x]
               # X's gradients (less its parameters where resharded first) with their input and output
               + [(nxt * gathers + x * kept) * pb + x * gb * (1 + 1 / dp + t) for x, _, _, nxt in rows if x]
               # the root's own reduce-scatter, last, beside nothing else of FSDP2's
               + [root * kept * pb + root * gb * (1 + 1 / dp + t)], default=0.0)
    return most


def _fsdp_extra(zero, dp, blocks, root_params, pb, gb, shard_pb, emb, head, head_held):
    """(held, transient) of ZeRO 0 and 1, and what ZeRO 2 and 3 hold all step."""
    if dp <= 1:
        return 0.0, 0.0
    group = max(blocks + [root_params, emb, head])
    if zero == 0:
        return 0.0, group * gb
    if zero in (1, 2):
        return ((sum(blocks) + root_params + emb + head) * (pb if shard_pb is None else shard_pb) / dp,
                group * gb if zero == 1 else 0.0)
    # the groups not resharded after forward
    return (root_params + (head if head_held else 0.0)) * pb, 0.0
