"""Building plans: the even split of layers into pipeline stages, and a validated hand-made plan
(what `trident plan` writes)."""
from __future__ import annotations

from planner.model import ConfigError, ModelConfig
from planner.plan import RUNTIME_RECV_BUFFERS, ClusterRef, Mesh, Pipeline, Plan, Stage, Training


def even_stages(model: ModelConfig, pp: int, virtual_stages: int = 1, zero: int = 0,
                recompute: str = "none", sequence_parallel: bool = False) -> list[Stage]:
    """Split layers 0..L+1 into pp * v contiguous stages. When the blocks divide evenly, every
    stage gets the same number of blocks and the first and last stages also take the embedding
    and the head (Megatron-LM's split); otherwise the layers are spread as evenly as counts
    allow, extra layers going to the middle stages (so with L + 2 divisible, the first and last
    stages hold one block fewer, as Llama 3 did)."""
    n = pp * virtual_stages
    total = model.num_layers_total
    if n > total:
        raise ConfigError(f"mesh.pp: {pp} x {virtual_stages} virtual stages is more stages than the "
                          f"{total} layers (embedding + {model.layers} blocks + head); lower pp or virtual stages")
    if model.layers % n == 0:
        sizes = [model.layers // n] * n
        sizes[0] += 1
        sizes[-1] += 1
    else:
        base, extra = divmod(total, n)
        sizes = [base] * n
        order = sorted(range(n), key=lambda i: (i in (0, n - 1), abs(i - (n - 1) / 2)))
        for i in order[:extra]:
            sizes[i] += 1
    stages, start = [], 0
    for size in sizes:
        rec = ["none" if model.layer_kind(l) != "block" else recompute for l in range(start, start + size)]
        stages.append(Stage(layers=[start, start + size], zero=zero, recompute=rec,
                            sequence_parallel=sequence_parallel))
        start += size
    return stages


def build_plan(model: ModelConfig, *, cluster_name: str, device: str, nodes: int, devices_per_node: int,
               global_batch: int, micro_batch: int, seq_len: int | None = None, tp: int = 1, pp: int = 1,
               dp: int | None = None, schedule: str = "1f1b", virtual_stages: int = 1, recompute: str = "none",
               sequence_parallel: bool = False, zero: int = 0, dtype: str = "bf16", profile_hash: str = "",
               order: list | None = None, stages: list | None = None, lockstep: bool = False,
               recv_buffers: str = RUNTIME_RECV_BUFFERS, p2p: str = "full", sent_outputs: str = "kept",
               dp_replicate: int = 1, cp: int = 1, ep: int = 1, **training_overrides) -> Plan:
    """A validated hand-made plan. `dp` defaults to world / (tp * pp * cp); `stages` defaults to an
    even split; `order` to pp, dp, (cp,) tp. Raises ConfigError naming the field on any inconsistency."""
    world = nodes * devices_per_node
    if dp is None:
        if world % (tp * pp * cp):
            raise ConfigError(f"mesh: tp x pp{' x cp' if cp > 1 else ''} = {tp * pp * cp} does not divide the "
                              f"{world} GPUs; pick degrees whose product divides the GPU count")
        dp = world // (tp * pp * cp)
    if pp == 1:
        virtual_stages = 1  # a schedule with one stage has nothing to interleave
    if schedule == "interleaved-1f1b" and virtual_stages == 1 and pp > 1:
        schedule = "1f1b"  # interleaving with one chunk per rank is plain 1F1B
    if schedule == "zbv" and virtual_stages == 1 and pp > 1:
        virtual_stages = 2  # ZB-V's only value
    mb_count = global_batch // (dp * micro_batch) if dp * micro_batch else 0
    plan = Plan(
        model=model,
        training=Training(global_batch=global_batch, micro_batch=micro_batch,
                          seq_len=seq_len if seq_len is not None else model.seq_len, dtype=dtype,
                          **{"master_weights": dtype != "fp32", **training_overrides}),
        cluster=ClusterRef(name=cluster_name, nodes=nodes, devices_per_node=devices_per_node,
                           device=device, profile_hash=profile_hash),
        mesh=Mesh(pp=pp, dp=dp, tp=tp, order=list(order) if order else ["pp", "dp"] + ["cp"] * (cp != 1) + ["tp"],
                  dp_replicate=dp_replicate, cp=cp, ep=ep),
        pipeline=Pipeline(schedule=schedule, virtual_stages=virtual_stages, micro_batches=mb_count,
                          stages=stages if stages is not None else even_stages(
                              model, pp, virtual_stages, zero, recompute, sequence_parallel and tp > 1),
                          lockstep=lockstep, recv_buffers=recv_buffers, p2p=p2p, sent_outputs=sent_outputs),
    )
    return plan.validate()
