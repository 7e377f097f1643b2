"""The plan file: the one contract between the planner and the runtime.

A plan says everything the runtime needs to train (model, training settings, mesh, pipeline
stages with their ZeRO level, recomputation and sequence parallelism) and everything the
prediction assumed (which cluster profile priced it, and the prediction itself).

Conventions:
- Layers are numbered as in planner.model: 0 = embedding, 1..L = blocks, L+1 = final norm + head.
  A stage owns the half-open range `layers = [start, end)`.
- `mesh`: degrees and rank order, planner.mesh (context parallelism `cp` there too).
- With `virtual_stages` v > 1 (interleaved 1F1B) there are pp * v stages (model chunks); chunk i
  lives on pipeline rank i % pp, as torch.distributed.pipelining's interleaved schedules expect.
  ZB-V (`zbv`) has two chunks per rank placed in a V: chunk i on rank i for i < pp, else on rank
  2 pp - 1 - i (torch's ScheduleZBVZeroBubble), so rank 0 holds the first and the last.
- ZeRO level per stage: 0 = plain data parallel (parameters, gradients and optimizer state
  replicated), 1 = optimizer state sharded over dp, 2 = gradients too, 3 = parameters too
  (FSDP, resharded after forward). With `mesh.dp_replicate` R > 1 (HSDP) "dp" there means a shard
  group of dp / R consecutive dp coordinates, whose shards the R groups all-reduce; with `mesh.cp`
  C > 1 (context parallelism) it spans C times as many ranks, the CP ranks of each dp coordinate.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from planner.mesh import Mesh
from planner.model import ConfigError, ModelConfig, is_int as _is_int
from planner.profile_checks import check_finite, parse_json, read_input, unreadable
from planner.values import strict as _strict

FORMAT_VERSION = 1
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zbv")


def split_backward(schedule: str, pp: int) -> bool:
    """Whether a pipeline runs each backward as two operations, I (input gradients) and W (weight
    gradients): zbv with a pipeline."""
    return schedule == "zbv" and pp > 1


def stage_rank(schedule: str, pp: int, stage_index: int) -> int:
    """Pipeline rank of model chunk `stage_index`: i % pp, or in a V under zbv (2 pp - 1 - i from pp on)."""
    if schedule == "zbv" and stage_index >= pp:
        return 2 * pp - 1 - stage_index
    return stage_index % pp
RECV_BUFFERS = ("preallocated", "in-flight")  # see Pipeline.recv_buffers
RUNTIME_RECV_BUFFERS = "in-flight"  # the runtime's, the default (and so the search's)
SENT_OUTPUTS = ("kept", "freed")  # see Pipeline.sent_outputs
P2P_MODES = ("full", "scatter-gather")  # see Pipeline.p2p
GRAD_ACCUMULATION = ("separate-fp32", "separate-16bit", "fused", "fused-16bit")  # see Training.grad_accumulation
SP_SAVED_INPUTS = ("gathered", "shard")  # see Training.sp_saved_inputs
LR_DECAYS = ("constant", "linear", "cosine")  # see Training.lr_decay
DTYPES = {"bf16": 2, "fp16": 2, "fp32": 4}
# options added after format 1, written only when they differ from their defaults (Plan.to_dict)
ADDED_OPTIONS = {"training": ("fp8", "fp8_param_gather", "tp_comm_overlap", "overlap_grad_reduce", "overlap_param_gather",
                              "async_tp_allreduce", "grad_accumulation", "elementwise_kernels", "fsdp_copies",
                              "sp_saved_inputs", "selective_recompute", "lr_warmup_steps", "lr_decay", "lr_decay_steps",
                              "min_lr", "attention_dropout", "document_mask", "eod_mask_loss", "reset_position_ids",
                              "moe_aux_loss", "moe_load_factor", "adam_moments", "defer_grad_sync"),
                 "pipeline": ("lockstep", "recv_buffers", "p2p", "sent_outputs"), "mesh": ("dp_replicate", "cp", "ep")}


def _default(cls, name: str):
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def _need(cond: bool, path: str, msg: str):
    if not cond:
        raise ConfigError(f"{path}: {msg}")


@dataclass
class Training:
    global_batch: int  # sequences per optimizer step
    micro_batch: int  # sequences per micro-batch per data-parallel rank
    seq_len: int
    dtype: str = "bf16"  # compute dtype: bf16 | fp16 | fp32
    # the blocks' linear products on FP8 tensor cores, by scaling recipe (planner.fp8: tensorwise,
    # current, delayed, mxfp8), the rest in `dtype`; null: none. Prediction only (runtime.run_checks)
    fp8: str | None = None
    # the FP8 linears' weights held, and all-gathered by data parallelism, as their 8-bit copies
    # (Megatron-LM's --fp8-param-gather, torchtitan's enable_fsdp_float8_all_gather; planner.fp8)
    fp8_param_gather: bool = False
    master_weights: bool = True  # fp32 master copy in the optimizer (mixed precision); ignored for fp32
    adam_moments: str = "fp32"  # AdamW's moments: fp32 | param_dtype, that of what it updates (planner.precision)
    optimizer: str = "adamw"
    lr: float = 3e-4
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    # dropout probabilities (runtime.dropout): `dropout` on the hidden states (the embedding's output,
    # each block's attention and MLP outputs), `attention_dropout` on the attention probabilities,
    # null: the same as `dropout` (Megatron-LM's --hidden-dropout and --attention-dropout, both 0.1
    # by default)
    dropout: float = 0.0
    attention_dropout: float | None = None
    attention: str = "flash"  # flash / flash-triton: fused, no s^2 scores kept; unfused: materialized softmax (model.py)
    # attention stays inside each document of a packed sequence (Megatron-LM's --reset-attention-mask,
    # Llama 3's document mask; runtime.documents): an explicit s x s mask per micro-batch, which the
    # fused kernel computes in full (planner.layers.attention_core_hw_flops, planner.memory)
    document_mask: bool = False
    # no loss where the input is the end-of-text id (predicting the next document's first token;
    # Megatron-LM's --eod-mask-loss), every other token weighted alike over the global batch
    # (runtime.loss); no effect on the prediction
    eod_mask_loss: bool = False
    # positions restart at 0 with each document of a row (Megatron-LM's --reset-position-ids; under
    # a document mask only), so a document's logits are those it has alone under GPT's learned
    # positions too (RoPE sees distances alone); no effect on the prediction
    reset_position_ids: bool = False
    # the coefficient of the mixture-of-experts load-balancing loss (Fedus et al. 2022, eq. 4; their
    # 0.01), summed over the MoE blocks (runtime.moe); 0: none. Its few bytes a token are not priced
    moe_aux_loss: float = 0.0
    # the busiest expert's routed rows over the mean, each micro-batch (1: balanced routing): under
    # expert parallelism the rank holding it computes and receives that many more rows while its
    # EP group waits (planner.moe.expert_load); `trident run` measures it (run.json moe_load_factor)
    moe_load_factor: float = 1.0
    seed: int = 0
    # data-parallel gradient reduction overlaps the backward (FSDP2 / replicate hooks); false: it runs
    # after the whole backward (Megatron-LM v2.x local DDP, DeepSpeed's pipeline engine), planner.schedule
    overlap_grad_reduce: bool = True
    # ZeRO 1/2 gather the updated parameters in the next forward, beside it on GPUs (FSDP2, Megatron's --overlap-
    # param-gather); false: after the optimizer step (DeepSpeed's ZeRO 1); planner.comm.gather_beside_forward
    overlap_param_gather: bool = True
    # the backward's TP all-reduce of each column-parallel linear's input gradient runs alongside
    # that linear's weight-gradient GEMM (Megatron-LM from September 2021, --no-async-tensor-model-
    # parallel-allreduce to disable; planner.cost); DTensor's tensor parallelism, the runtime's, does not
    async_tp_allreduce: bool = False
    # under sequence parallelism, each dense block's TP all-gathers and reduce-scatters run beside
    # their linear layers' GEMMs (Megatron-LM's --tp-comm-overlap, TransformerEngine's userbuffers;
    # torchtitan's async TP; planner.comm.overlapped_sp_comm); prediction only
    tp_comm_overlap: bool = False
    # how micro-batch gradients add up (planner.cost): "separate-fp32", a pass over float32 gradients
    # (the runtime: autograd adds them into float32 parameters' gradients, and under bf16 FSDP2
    # accumulates its unsharded gradients in float32, its reduce dtype);
    # "separate-16bit", a pass over 16-bit gradients (Megatron-LM fp16 without fp32 accumulation,
    # DeepSpeed fp16); "fused", inside the weight-gradient GEMM (Megatron-LM's
    # gradient_accumulation_fusion) into float32 buffers; "fused-16bit", the same into 16-bit ones
    # (Megatron-LM with grad_reduce_in_fp32 false, as Megatron-Bridge's performance configs set it)
    grad_accumulation: str = "separate-fp32"
    # memory-bound operations (planner.pointwise): "eager", one PyTorch kernel per operation as the
    # runtime runs them (RMSNorm and rotary embeddings in float32 inside); "fused", one kernel per
    # fused group as Megatron-LM writes them; "fused-fp32-loss", with Megatron-LM's default float32 loss
    elementwise_kernels: str = "eager"
    # data parallelism copies parameters out of its all-gather buffers and gradients into its
    # reduce buffers on the compute stream (FSDP2 and replicate, the runtime's; planner.precision
    # fsdp_copy_bytes); false: flat buffers with nothing to copy (Megatron-LM's DDP, FSDP1)
    fsdp_copies: bool = True
    # ZeRO 2/3 reduce-scatter in the last micro-batch's backward alone (FSDP2 gradient sync off before it)
    defer_grad_sync: bool = False
    # what a column-parallel linear keeps for its weight gradient under sequence parallelism: "shard", this rank's
    # sequence shard, all-gathered again in the backward (Megatron-LM's LinearWithGradAccumulationAndAsync-
    # Communication, Korthikanti et al. 2022's accounting; runtime.sp_shard); "gathered", the whole input, as
    # DTensor's ColwiseParallel keeps it: more memory (planner.precision.sp_gathered_bytes), no 2nd all-gather
    sp_saved_inputs: str = "shard"
    selective_recompute: str = "attention"  # under "selective": attention core (Korthikanti's) | ops (planner.sac)
    # the learning rate of each step (runtime.optim.lr_at; Megatron-LM's --lr-warmup-iters, --lr-decay-style,
    # --lr-decay-iters, --min-lr): a linear warm-up to lr over the first lr_warmup_steps steps, then lr_decay
    # ("constant", "linear" or "cosine") down to min_lr at step lr_decay_steps (from the first step), min_lr after
    lr_warmup_steps: int = 0
    lr_decay: str = "constant"
    lr_decay_steps: int = 0
    min_lr: float = 0.0

    @property
    def attention_dropout_p(self) -> float:
        return self.dropout if self.attention_dropout is None else self.attention_dropout

    @property
    def lr_scheduled(self) -> bool:
        """Whether the learning rate moves (a warm-up or a decay), not lr at every step."""
        return bool(self.lr_warmup_steps) or self.lr_decay != "constant"


@dataclass
class ClusterRef:
    name: str
    nodes: int
    devices_per_node: int
    device: str
    profile_hash: str = ""  # sha256 of the cluster profile file that priced the plan

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node


@dataclass
class Stage:
    layers: list  # [start, end), half-open
    zero: int = 0
    recompute: list = field(default_factory=list)  # one mode per layer in the range
    sequence_parallel: bool = False

    @property
    def start(self) -> int:
        return self.layers[0]

    @property
    def end(self) -> int:
        return self.layers[1]

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]


@dataclass
class Pipeline:
    schedule: str
    virtual_stages: int
    micro_batches: int
    stages: list  # of Stage, pp * virtual_stages of them, in model order
    # ranks advance in lock-step with blocking neighbour exchanges (DeepSpeed's PipelineEngine
    # TrainSchedule; planner.schedule); the runtime's torch.distributed.pipelining does not
    lockstep: bool = False
    # receive buffers: "preallocated" (torch.distributed.pipelining's own: one input-activation
    # buffer per micro-batch on every stage but the first and one output-gradient buffer per
    # micro-batch on every stage but the last, allocated up front and held) or "in-flight"
    # (allocated per transfer, freed with the micro-batch: the runtime's, runtime.pipeline, since
    # session 34; Megatron-LM, DeepSpeed)
    recv_buffers: str = RUNTIME_RECV_BUFFERS
    # what a stage sends: "kept" (torch.distributed.pipelining, the runtime: each output to its
    # backward in the stage's forward cache, and under the schedules torch plays with its action
    # runtime each input gradient until it is known delivered, planner.sends;
    # planner.memory.stage_recv_bytes) or "freed"
    # (Megatron-LM: deallocate_output_tensor keeps only the output's autograd node once sent, and
    # each transfer is waited for as it goes; prediction only)
    sent_outputs: str = "kept"
    # activations and gradients between stages: "full" (every TP rank sends the whole tensor to its
    # peer: torch.distributed.pipelining, the runtime) or "scatter-gather" (each TP rank sends 1/tp of
    # it and the receiving TP group all-gathers: Megatron-LM's scatter/gather optimization, Narayanan et
    # al. SC'21 section 4.1, and DeepSpeed's partitioned pipeline tensors); planner.cost
    p2p: str = "full"


@dataclass
class Plan:
    model: ModelConfig
    training: Training
    cluster: ClusterRef
    mesh: Mesh
    pipeline: Pipeline
    prediction: dict | None = None
    format_version: int = FORMAT_VERSION

    # ------------------------------------------------------------ helpers
    @property
    def rank_micro_batch(self) -> float:
        """The share of a micro-batch one rank computes, in sequences: micro_batch, over cp under
        context parallelism (each rank holds 1 / cp of every sequence's tokens)."""
        return self.training.micro_batch / self.mesh.cp

    def stage_rank(self, stage_index: int) -> int:
        """Pipeline rank that holds model chunk `stage_index` (stage_rank below)."""
        return stage_rank(self.pipeline.schedule, self.mesh.pp, stage_index)

    def stages_of_rank(self, pp_rank: int) -> list[int]:
        return [i for i in range(len(self.pipeline.stages)) if self.stage_rank(i) == pp_rank]

    def recompute_of_layer(self, layer: int) -> str:
        for st in self.pipeline.stages:
            if st.start <= layer < st.end:
                return st.recompute[layer - st.start]
        raise IndexError(layer)

    # ------------------------------------------------------------ JSON
    def to_dict(self) -> dict:
        """The plan as JSON data. Options added after format 1 (ADDED_OPTIONS) are written only
        when they differ from their defaults, so that plans without them keep their bytes and
        content hash."""
        def changed(obj, names):
            return {k: getattr(obj, k) for k in names if getattr(obj, k) != _default(type(obj), k)}
        kept = changed(self.training, ADDED_OPTIONS["training"])
        training = {k: v for k, v in dataclasses.asdict(self.training).items()
                    if k not in ADDED_OPTIONS["training"] or k in kept}
        pipeline = changed(self.pipeline, ADDED_OPTIONS["pipeline"])
        return {
            "format_version": self.format_version,
            "model": self.model.to_dict(),
            "training": training,
            "cluster": dataclasses.asdict(self.cluster),
            "mesh": {k: v for k, v in dataclasses.asdict(self.mesh).items()
                     if k not in ADDED_OPTIONS["mesh"] or v != _default(Mesh, k)},
            "pipeline": {
                "schedule": self.pipeline.schedule,
                "virtual_stages": self.pipeline.virtual_stages,
                "micro_batches": self.pipeline.micro_batches,
                "stages": [dataclasses.asdict(s) for s in self.pipeline.stages],
                **pipeline,
            },
            "prediction": self.prediction,
        }

    def to_json(self) -> str:
        return dumps(self.to_dict())

    def write(self, path) -> None:
        try:
            Path(path).write_text(self.to_json())
        except OSError as exc:
            raise ConfigError(f"-o/--output: cannot write the plan to {path} ({exc.strerror}); "
                              "give a file path in an existing directory") from None

    def content_hash(self) -> str:
        """sha256 of what the runtime executes (the plan without its prediction)."""
        d = self.to_dict()
        d.pop("prediction")
        return "sha256:" + hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        _need(isinstance(d, dict), "plan", "expected a JSON object")
        _strict(cls, d, "plan")
        _need("format_version" in d, "format_version",
              f"missing; a plan starts with the format it is written in ({FORMAT_VERSION} here): regenerate it "
              "with `trident plan` or `trident search`")
        fv = d["format_version"]
        _need(_is_int(fv), "format_version", f"{fv!r} is not an integer")
        _need(fv <= FORMAT_VERSION, "format_version",
              f"{fv} is newer than this trident understands ({FORMAT_VERSION}); upgrade trident")
        _need(fv >= 1, "format_version", f"{fv} is not a valid version; this trident writes {FORMAT_VERSION}")
        model = ModelConfig.from_dict(d["model"], where="model")
        training = Training(**_strict(Training, d["training"], "training"))
        cluster = ClusterRef(**_strict(ClusterRef, d["cluster"], "cluster"))
        mesh = Mesh(**_strict(Mesh, d["mesh"], "mesh"))
        p = _strict(Pipeline, d["pipeline"], "pipeline")
        _need(isinstance(p["stages"], list), "pipeline.stages", "expected a list of stages")
        stages = [Stage(**_strict(Stage, s, f"pipeline.stages[{i}]")) for i, s in enumerate(p["stages"])]
        pipeline = Pipeline(schedule=p["schedule"], virtual_stages=p["virtual_stages"],
                            micro_batches=p["micro_batches"], stages=stages,
                            **{k: p[k] for k in ADDED_OPTIONS["pipeline"] if k in p})
        plan = cls(model=model, training=training, cluster=cluster, mesh=mesh, pipeline=pipeline,
                   prediction=d.get("prediction"), format_version=fv)
        plan.validate()
        return plan

    @classmethod
    def from_json(cls, text: str, source: str = "plan") -> "Plan":
        try:
            data = parse_json(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{source}: not valid JSON ({exc.msg} at line {exc.lineno}); "
                              "regenerate it with `trident plan` or `trident search`") from None
        except (ValueError, RecursionError) as exc:  # an integer of over 4300 digits, nesting too deep
            raise ConfigError(f"{source}: not valid JSON ({unreadable(exc)}); "
                              "regenerate it with `trident plan` or `trident search`") from None
        check_finite(data, source)
        return cls.from_dict(data)

    @classmethod
    def read(cls, path) -> "Plan":
        try:
            text = read_input(path, "plan").decode()
        except UnicodeDecodeError:
            raise ConfigError(f"plan: {path} is not a text (UTF-8) file; give the plan.json that "
                              "`trident plan` or `trident search` wrote") from None
        return cls.from_json(text, source=str(path))

    # ------------------------------------------------------------ validation
    def validate(self) -> "Plan":
        """Raise ConfigError naming the first field that is wrong and how to fix it (planner.plan_checks)."""
        from planner.plan_checks import check
        check(self)
        return self

def dumps(obj) -> str:
    """JSON with two-space indentation, short lists of scalars kept on one line; stable, so that
    write -> read -> write is byte-identical."""
    def emit(o, ind):
        pad = "  " * ind
        if isinstance(o, dict):
            if not o:
                return "{}"
            items = [f'{pad}  {json.dumps(k)}: {emit(v, ind + 1)}' for k, v in o.items()]
            return "{\n" + ",\n".join(items) + "\n" + pad + "}"
        if isinstance(o, list):
            if all(not isinstance(x, (dict, list)) for x in o):
                return "[" + ", ".join(json.dumps(x) for x in o) + "]"
            return "[\n" + ",\n".join(f"{pad}  {emit(x, ind + 1)}" for x in o) + "\n" + pad + "]"
        return json.dumps(o)
    return emit(obj, 0) + "\n"


def priced_on(plan: Plan, cluster) -> tuple[Plan, str]:
    """The plan with its cluster reference naming the profile that prices it, and a note where
    that is not the one the plan names (another profile, given with --cluster; the same name with
    another device; the same profile changed since the plan was priced), else "". `cluster`: a
    planner.cluster.ClusterSpec."""
    ref, dev = plan.cluster, cluster.device.name
    if (ref.name, ref.device) != (cluster.name, dev):
        note = f"priced on {cluster.name} ({dev}), not the plan's {ref.name} ({ref.device})"
    elif ref.profile_hash and ref.profile_hash != cluster.profile_hash:
        note = (f"cluster profile {cluster.name} changed since this plan was priced "
                f"({ref.profile_hash[:19]} -> {cluster.profile_hash[:19]})")
    else:
        return plan, ""
    return dataclasses.replace(plan, cluster=dataclasses.replace(ref, name=cluster.name, device=dev,
                                                                 profile_hash=cluster.profile_hash)), note
