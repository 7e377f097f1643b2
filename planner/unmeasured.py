"""What a model profile is measured without, and its price: runtime.profile_model times each layer
as the runtime runs it, so a plan that sets anything else is priced from the profile plus the
analytic model's difference for it (planner.model_profile.profiled_layer_cost)."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from planner.plan import Training

if TYPE_CHECKING:
    from planner.cluster import ClusterSpec
    from planner.plan import Plan, Stage

# what runtime.profile_model measures a layer with, training fields a plan may set otherwise, at
# their defaults (planner.plan.Training: the runtime's): no dropout or document mask, even routing,
# the runtime's kernels (no FP8 linears, its eager elementwise kernels, TP collectives after their
# GEMMs: planner/fp8.py, planner/pointwise.py, planner/comm.py); and no expert parallelism (the
# mesh's ep)
MEASURED_WITH = {f.name: f.default for f in dataclasses.fields(Training) if f.name in (
    "dropout", "attention_dropout", "document_mask", "moe_load_factor", "fp8", "fp8_param_gather",
    "elementwise_kernels", "tp_comm_overlap", "async_tp_allreduce", "selective_recompute")}


def unmeasured(plan) -> bool:
    """Whether the plan sets anything a model profile is measured without (MEASURED_WITH; an
    attention dropout left to follow the hidden one, by its probability)."""
    t = plan.training
    return plan.mesh.ep > 1 or t.attention_dropout_p > 0 or any(
        getattr(t, k) != v for k, v in MEASURED_WITH.items() if k != "attention_dropout")


def unmeasured_delta(plan: Plan, cluster: ClusterSpec, index: int, stage: Stage, tp_ranks: list) -> tuple:
    """(forward s, backward s, kept bytes, replay bytes, forward TP s, backward TP s) what the
    plan's settings beyond what a model profile is measured with (MEASURED_WITH) add to a layer, as
    the analytic model prices them (planner.layers.layer_cost with and without; negative where they
    save): dropout and a document mask, the MoE load factor (its busiest expert's rows beyond the
    mean) and expert parallelism's local copies (planner.moe.dispatch_bytes), FP8 linears (their
    GEMMs, casts and 8-bit saved inputs), fused elementwise kernels, and TP communication beside
    the GEMMs (runtime.profile_model runs none of these; random weights route about evenly)."""
    from types import SimpleNamespace
    from planner.layers import layer_cost
    without = dict(training=dataclasses.replace(plan.training, **MEASURED_WITH), mesh=dataclasses.replace(plan.mesh, ep=1))
    # a Plan, or the search's stand-in for one (planner.search.Ctx.layers)
    plain = (dataclasses.replace(plan, **without) if dataclasses.is_dataclass(plan)
             else SimpleNamespace(**{**vars(plan), **without}))
    a, b = layer_cost(plan, cluster, index, stage, tp_ranks), layer_cost(plain, cluster, index, stage, tp_ranks)
    return (a.fwd_compute_s - b.fwd_compute_s, a.bwd_compute_s - b.bwd_compute_s,
            a.activation_bytes - b.activation_bytes, a.replay_bytes - b.replay_bytes,
            a.fwd_tp_s - b.fwd_tp_s, a.bwd_tp_s - b.bwd_tp_s)
