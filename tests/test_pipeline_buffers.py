"""Pipeline transfer buffers: torch.distributed.pipelining's own (one receive buffer per micro-batch,
held all step) and the runtime's in-flight ones (runtime.pipeline), as the planner counts them
(planner.memory.stage_recv_bytes) and as a run holds them."""
from __future__ import annotations

import dataclasses
import json

import pytest

from planner.cost import estimate
from planner.plan import Plan
from planner.zoo import ZOO
from test_cost import A100, plan_for  # llama2-7b plans on one DGX A100 node
from torchrun_helpers import assert_ok, losses_of, train, write_plan


def test_pipeline_transfer_buffers_by_mode():
    """recv_buffers preallocated (torch.distributed.pipelining's own) holds an input buffer per
    micro-batch on every stage but the first and a gradient buffer per micro-batch on every stage
    but the last, all step; in-flight (the runtime's, Megatron-LM's) each with its micro-batch,
    counted as its activation, and with torch's transfers one of each kind beyond that. Torch keeps
    each stage's output (but the last's) from its forward to its backward, 1F1B's p - rank
    micro-batches in flight; Megatron-LM frees it once sent and waits for each transfer
    (sent_outputs freed). Interleaved schedules, which torch plays with its action runtime, hold
    the input gradients they have sent until word comes back that they were consumed
    (planner.sends), in both modes."""
    kw = dict(pp=4, tp=2, global_batch=64)
    pre, flight, freed = (estimate(plan_for(recv_buffers=r, sent_outputs=o, **kw), A100)
                          for r, o in (("preallocated", "kept"), ("in-flight", "kept"), ("in-flight", "freed")))
    plan = plan_for(**kw)
    msg = 2 * plan.training.micro_batch * plan.training.seq_len * plan.model.hidden
    m = plan.pipeline.micro_batches
    for rank, (buffers, outputs) in enumerate(zip((1, 2, 2, 1), (4, 3, 2, 0))):
        a, b, c = (e.stages[rank]["memory"] for e in (pre, flight, freed))
        assert a - b == pytest.approx(buffers * (m - 1) * msg)
        assert b - c == pytest.approx((outputs + buffers) * msg)
    assert pre.step_time_s == flight.step_time_s == freed.step_time_s
    one = estimate(plan_for(global_batch=64), A100)  # no pipeline, no buffers
    assert estimate(plan_for(global_batch=64, recv_buffers="preallocated"), A100).peak_memory_bytes == one.peak_memory_bytes
    kw = dict(pp=2, tp=2, global_batch=64, schedule="interleaved-1f1b", virtual_stages=2)
    pre, flight = (estimate(plan_for(recv_buffers=r, **kw), A100).breakdown["memory_per_pp_rank"]
                   for r in ("preallocated", "in-flight"))
    m = plan_for(**kw).pipeline.micro_batches
    # each rank (chunks 0 and 2, 1 and 3) receives three kinds of transfer; both hold the sent gradients
    assert [a - b for a, b in zip(pre, flight)] == pytest.approx([3 * (m - 1) * msg] * 2)


def test_in_flight_buffers_train_the_same_and_hold_less(tmp_path):
    """The same pp 2 plans with torch's preallocated receive buffers and with the runtime's
    in-flight ones (1F1B, and interleaved 1F1B, whose sends torch holds to the end of the step):
    the same losses; each rank holds less, by about what the planner counts; and every rank
    within CPU heap noise (3%) of its prediction, never further under. So too a 1F1B plan of a
    vocabulary 8 times as large, whose logits (4 MiB a micro-batch) the schedule would keep
    through the last stage's backward: 5.3% over its prediction before the runtime freed them
    (runtime.pipeline._freeing_logits). And interleaved plans of 16 and 128 micro-batches of one
    sequence: torch's action runtime would hold every input gradient sent until the step ends (the
    second rank 7 MiB more at 128 than at 16); the runtime lets each go once its receiver is known
    to have consumed it (planner.sends), so both hold the same within 1 MiB."""
    deep = dataclasses.replace(ZOO["tiny"], name="tiny-deep", layers=4, hidden=256, ffn_hidden=768, vocab=1024)
    kinds = (("1f1b", 1), ("interleaved-1f1b", 2))
    paths = {(s, r): write_plan(tmp_path, f"{s}-{r}", deep, world=2, pp=2, schedule=s, virtual_stages=v,
                                global_batch=64, micro_batch=4, recv_buffers=r)
             for s, v in kinds for r in ("preallocated", "in-flight")}
    wide = dataclasses.replace(deep, name="tiny-deep-wide", vocab=8192)
    paths["1f1b", "wide"] = write_plan(tmp_path, "1f1b-wide", wide, world=2, pp=2, schedule="1f1b", global_batch=64,
                                       micro_batch=4)
    for m in (16, 128):
        paths["interleaved-1f1b", m] = write_plan(tmp_path, f"interleaved-{m}", deep, world=2, pp=2, micro_batch=1,
                                                  schedule="interleaved-1f1b", virtual_stages=2, global_batch=m)
    (tmp_path / "runs").mkdir()
    assert_ok(train(2, "--plan", *paths.values(), "--steps", 2, "--out", tmp_path / "runs"))
    cluster = dataclasses.replace(A100.shaped_as(1, 2), backend="gloo")
    got, want = {}, {}
    for key, path in paths.items():
        got[key] = json.loads((tmp_path / "runs" / f"{path.stem}.json").read_text())["peak_memory_bytes_per_rank"]
        want[key] = estimate(Plan.read(path), cluster).breakdown["memory_per_pp_rank"]
        for rank, (g, w) in enumerate(zip(got[key], want[key])):
            assert 0.85 * w <= g <= 1.03 * w, (path.stem, rank, g / w)
    for s, _ in kinds:
        pre, flight = (s, "preallocated"), (s, "in-flight")
        assert losses_of(tmp_path / "runs" / f"{s}-in-flight.json") == losses_of(tmp_path / "runs" / f"{s}-preallocated.json")
        for rank in range(2):
            saved, priced = got[pre][rank] - got[flight][rank], want[pre][rank] - want[flight][rank]
            assert 0.8 * priced <= saved <= 1.2 * priced, (s, rank, saved, priced)
    few, many = got["interleaved-1f1b", 16], got["interleaved-1f1b", 128]
    assert all(abs(a - b) < 2**20 for a, b in zip(few, many)), (few, many)
