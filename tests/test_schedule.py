"""The schedule simulator against hand-computed timelines."""
import pytest

from planner.orders import peak_in_flight, peak_with_gradients, rank_order
from planner.schedule import Sharing, StageTimes, beside_backward, simulate


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (4, 8), (8, 3)])
def test_bubble_is_p_minus_1_over_m_plus_p_minus_1(schedule, p, m):
    tl = simulate(schedule, p, 1, m, [StageTimes(1.0, 2.0) for _ in range(p)], p2p=False)
    assert tl.step_time_s == pytest.approx((m + p - 1) * 3.0)
    assert tl.bubble_fraction() == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (4, 3, 8)])
def test_interleaving_divides_the_bubble_by_v(p, v, m):
    tl = simulate("interleaved-1f1b", p, v, m, [StageTimes(1.0 / v, 2.0 / v) for _ in range(p * v)], p2p=False)
    ideal = m * 3.0
    assert tl.step_time_s == pytest.approx(ideal + (p - 1) * 3.0 / v)


def test_hand_computed_two_stage_timeline_with_transfers():
    # F=1, B=2, transfer 0.5 each way, 2 micro-batches, 1F1B on 2 stages; a rank waits for its sends.
    # rank 0: F0 [0,1] + send -> 1.5; F1 [1.5,2.5] + send -> 3; B0 needs rank 1's B0 (4.5) + 0.5 -> [5,7];
    #         B1 needs 8 + 0.5 -> [8.5,10.5]
    # rank 1: F0 arrives 1.5 -> [1.5,2.5]; B0 [2.5,4.5] + send -> 5; F1 (arrived 3) [5,6]; B1 [6,8] + send
    st = [StageTimes(1, 2, send_fwd_s=0.5, send_bwd_s=0.5) for _ in range(2)]
    tl = simulate("1f1b", 2, 1, 2, st)
    r0 = [(o.kind, o.micro_batch, o.start_s, o.end_s) for o in tl.ops[0]]
    r1 = [(o.kind, o.micro_batch, o.start_s, o.end_s) for o in tl.ops[1]]
    assert r0 == [("F", 0, 0, 1), ("F", 1, 1.5, 2.5), ("B", 0, 5.0, 7.0), ("B", 1, 8.5, 10.5)]
    assert r1 == [("F", 0, 1.5, 2.5), ("B", 0, 2.5, 4.5), ("F", 1, 5.0, 6.0), ("B", 1, 6.0, 8.0)]
    assert tl.step_time_s == 10.5
    # with background sends only the receiver waits
    tl = simulate("1f1b", 2, 1, 2, st, blocking_p2p=False)
    assert [(o.start_s, o.end_s) for o in tl.ops[1]] == [(1.5, 2.5), (2.5, 4.5), (4.5, 5.5), (5.5, 7.5)]
    assert tl.step_time_s == 10.0


@pytest.mark.parametrize("p,m", [(4, 8), (4, 2), (8, 16)])
def test_1f1b_peak_in_flight_is_p_minus_stage(p, m):
    for r in range(p):
        assert peak_in_flight("1f1b", p, 1, m, r) == min(p - r, m)
        assert peak_in_flight("gpipe", p, 1, m, r) == m


def test_every_operation_runs_exactly_once():
    for sched, v in (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-1f1b", 4)):
        p, m = 4, 8
        ops = [o for r in range(p) for o in rank_order(sched, p, v, m, r)]
        assert len(ops) == len(set(ops)) == 2 * p * v * m


def test_grad_sync_overlaps_remaining_backward():
    st = [StageTimes(1, 2, grad_sync_s=1.0) for _ in range(2)]
    tl = simulate("1f1b", 2, 1, 4, st, p2p=False)
    assert tl.end_s[1] == pytest.approx(tl.compute_end_s[1] + 1.0) or tl.end_s[1] <= tl.compute_end_s[0] + 1.0
    assert tl.end_s[0] == pytest.approx(tl.compute_end_s[0] + 1.0)


def test_grad_sync_in_parts_runs_beside_the_last_backward():
    # one stage, 2 micro-batches of F 1 and B 2: the last B runs over [4, 6]. Parts (done, seconds):
    # (0.25, 1.0) ready at 4.5, ends 5.5; (0.5, 0.25) ready at 5.0, queued to 5.75; (1.0, 0.5) ready
    # at 6.0, ends 6.5: 0.5 exposed where the whole 1.75 after the backward ends at 7.75
    parts = ((0.25, 1.0), (0.5, 0.25), (1.0, 0.5))
    tl = simulate("1f1b", 1, 1, 2, [StageTimes(1.0, 2.0, grad_sync_s=1.75, grad_sync_parts=parts)])
    assert tl.compute_end_s[0] == 6.0 and tl.end_s[0] == pytest.approx(6.5) and tl.comm_intervals[0] == [(0, 4.5, 6.5)]
    whole = simulate("1f1b", 1, 1, 2, [StageTimes(1.0, 2.0, grad_sync_s=1.75)])
    off = simulate("1f1b", 1, 1, 2, [StageTimes(1.0, 2.0, grad_sync_s=1.75, grad_sync_parts=parts)],
                   overlap_grad_reduce=False)
    assert whole.end_s[0] == off.end_s[0] == pytest.approx(7.75)


def test_a_reduction_beside_the_last_backward_slows_it_by_the_share_it_takes():
    # as above with steal 0.5 (a compute slowdown of 2 while a part runs): relative to the last B's
    # start, part 1 (ready at 0.5 of work) runs [0.5, 1.5], the B reaching 1.0 of work at 1.5 (0.5
    # at half rate); part 2 runs [1.5, 1.75]; the B reaches 1.125 at 1.75, then 2.0 at 2.625, where
    # part 3 runs to 3.125. The B ends 0.625 late: half of the 1.25 s the parts overlapped it
    parts = ((0.25, 1.0), (0.5, 0.25), (1.0, 0.5))
    took, pieces = beside_backward(2.0, parts, 0.5)
    assert took == pytest.approx(2.625)
    assert [x for p in pieces for x in p] == pytest.approx([0.5, 1.5, 1.5, 1.75, 2.625, 3.125])
    tl = simulate("1f1b", 1, 1, 2, [StageTimes(1.0, 2.0, grad_sync_s=1.75, grad_sync_parts=parts)], steal=0.5)
    assert tl.compute_end_s[0] == pytest.approx(6.625) and tl.end_s[0] == pytest.approx(7.125)
    assert tl.slowed_s == pytest.approx([0.625])
    (stage, begin, end), = tl.comm_intervals[0]
    assert stage == 0 and begin == pytest.approx(4.5) and end == pytest.approx(7.125)
    # the stage before waits for it: two stages, the last's reduction slows its last B and so the
    # first stage's last B starts that much later
    two = [StageTimes(1.0, 2.0), StageTimes(1.0, 2.0, grad_sync_s=1.75, grad_sync_parts=parts)]
    fast, slow = (simulate("1f1b", 2, 1, 2, two, p2p=False, steal=x) for x in (0.0, 0.5))
    assert slow.compute_end_s[0] - fast.compute_end_s[0] == pytest.approx(0.625)
    assert slow.slowed_s == pytest.approx([0.0, 0.625])
    # with the reduction after the backward, nothing runs beside it: nothing slows
    off = simulate("1f1b", 1, 1, 2, [StageTimes(1.0, 2.0, grad_sync_s=1.75, grad_sync_parts=parts)], steal=0.5,
                   overlap_grad_reduce=False)
    assert off.end_s[0] == pytest.approx(7.75) and off.compute_end_s[0] == 6.0


def test_zero3_gathers_share_the_reductions_communicator_in_the_last_backward():
    # three layers of backward 1.0 each; each gathers 0.5 before it and reduces 1.0 after it, on
    # one FIFO stream (steal 0). g0 [0, 0.5] (the backward waits), g1 issued then [0.5, 1.0]; r0
    # ready at 1.5 runs [1.5, 2.5]; g2, issued at layer 1's start, queues behind it [2.5, 3.0], so
    # layer 2 waits from 2.5 to 3.0; r1 [3.0, 4.0]; the backward ends at 4.0, r2 [4.0, 5.0]
    gathers = ((0.0, 0.5), (1 / 3, 0.5), (2 / 3, 0.5))
    parts = ((1 / 3, 1.0), (2 / 3, 1.0), (1.0, 1.0))
    took, pieces = beside_backward(3.0, parts, 0.0, gathers=gathers)
    assert took == pytest.approx(4.0)
    assert [x for p in pieces for x in p] == pytest.approx([1.5, 2.5, 3.0, 4.0, 4.0, 5.0])
    assert beside_backward(3.0, parts, 0.0) == (3.0, [(1.0, 2.0), (2.0, 3.0), (3.0, 4.0)])  # the reductions alone
    # while the stream is busy the backward runs at 1 - steal: g1 [0.5, 1.0] beside layer 0 (done
    # 0.25 by 1.0, the rest by 1.75), r0 [1.75, 2.75] and g2 [2.75, 3.25] beside layer 1 (done 0.75
    # by 3.25, the rest by 3.5), so its gather is there when layer 2 needs it; r1 [3.5, 4.5] beside
    # layer 2 (done 0.5 by 4.5, the rest by 5.0), r2 [5.0, 6.0]
    took, pieces = beside_backward(3.0, parts, 0.5, gathers=gathers)
    assert took == pytest.approx(5.0)
    assert [x for p in pieces for x in p] == pytest.approx([1.75, 2.75, 3.5, 4.5, 5.0, 6.0])
    # in a step: one micro-batch, its backward priced 3.5 (the gathers' 0.5 exposed apart), played 4.0
    st = StageTimes(1.0, 3.5, grad_sync_s=3.0, grad_sync_parts=parts, bwd_gathers=gathers, bwd_gather_s=0.5)
    tl = simulate("1f1b", 1, 1, 1, [st])
    assert tl.compute_end_s[0] == pytest.approx(5.0) and tl.end_s[0] == pytest.approx(6.0)
    assert tl.slowed_s == pytest.approx([0.5])


def test_a_gpu_stage_reduces_its_gradients_layer_by_layer_beside_its_last_backward():
    """FSDP2 and Megatron-LM's DDP reduce each block's (bucket's) gradients once complete, beside
    the rest of the backward: on a GPU cluster a data-parallel plan without a pipeline exposes
    about the last layers' reductions (the embedding's, its backward next to nothing, queued after
    the first block's), not the whole stage's; CPU processes (gloo) reduce after the backward
    (planner.comm.reduce_beside_backward)."""
    import dataclasses
    from planner.build import build_plan
    from planner.cluster import load_cluster
    from planner.cost import estimate
    from planner.zoo import ZOO
    from planner.layers import layer_params_on_device
    shipped = load_cluster("dgx-a100-80gb", nodes=1)
    a100 = dataclasses.replace(shipped, overlap_slowdown=1.0)  # the reduction slows no compute (below: it does)
    plan = build_plan(ZOO["llama2-7b"], cluster_name=a100.name, device=a100.device.name, nodes=1, devices_per_node=8,
                      global_batch=8, micro_batch=1, seq_len=4096, zero=1, overlap_param_gather=False)
    gpu, cpu = estimate(plan, a100), estimate(plan, dataclasses.replace(a100, backend="gloo"))
    st = gpu.stages[0]
    emb, blk = (a100.collective_time("reduce_scatter", layer_params_on_device(plan.model, i, 1) * 4, range(8))
                for i in (0, 1))
    other = cpu.breakdown["time"]["dp_comm_exposed_s"] - st["grad_sync_s"]  # the rest of the DP time, the same on both
    exposed = gpu.breakdown["time"]["dp_comm_exposed_s"] - other
    assert emb < exposed < emb + blk < st["grad_sync_s"] / 10
    assert cpu.step_time_s - gpu.step_time_s == pytest.approx(st["grad_sync_s"] - exposed, rel=1e-6)
    # the shipped profile's collectives take 1 - 1/1.189 of the compute rate while they run: the
    # parts that ran beside the backward (all but what was exposed, about) slow it by that share
    slowed = estimate(plan, shipped)
    steal = 1 - 1 / shipped.overlap_slowdown
    extra = slowed.step_time_s - gpu.step_time_s
    assert steal * (st["grad_sync_s"] - emb - blk) < extra < steal * st["grad_sync_s"]
    assert slowed.breakdown["time"]["dp_comm_exposed_s"] - gpu.breakdown["time"]["dp_comm_exposed_s"] == \
        pytest.approx(extra, rel=1e-6)
    assert slowed.breakdown["time"]["pipeline_bubble_s"] == 0.0


def test_a_zero3_step_carries_its_gathers_and_reductions_one_after_another():
    """FSDP2 issues its all-gathers and reduce-scatters on one communicator, which runs them one at a
    time (planner.schedule.beside_backward): Llama 3 8B under ZeRO 3 on 4 nodes of 8 H100s whose
    inter-node collectives run at 1.5 GB/s, one micro-batch, lasts at least every gather of its
    forward, then every gather of its backward (not the head's: runtime.parallelize keeps it from
    its forward to its backward) and every reduce-scatter. Priced apart, the backward's gathers
    exposed beside its compute alone and its reduction beside it, the step came out 3.97 s. With 2
    and 4 micro-batches each does so, and the step lasts m times that, less than a head's gather
    more a micro-batch: the last backward's reduce-scatters counted beside it and again after it
    made it 0.68 s (0.74 s) longer."""
    import json

    from planner.build import build_plan
    from planner.cluster import PROFILE_DIR, cluster_from_dict
    from planner.cost import estimate
    from planner.layers import layer_params_on_device
    from planner.zoo import ZOO
    d = json.loads((PROFILE_DIR / "dgx-h100-80gb.json").read_text())
    for op in ("reduce_scatter", "all_gather"):
        d["collectives"][op]["inter_node"] = {"alpha_s": 5e-5, "bus_bandwidth_bytes_per_s": 1.5e9}
    h100 = cluster_from_dict(d).shaped_as(4, 8)
    m = ZOO["llama3-8b"]
    gathers, reductions = ([h100.collective_time(op, layer_params_on_device(m, i, 1) * nbytes, range(32))
                            for i in range(m.num_layers_total)]
                           for op, nbytes in (("all_gather", 2), ("reduce_scatter", 4)))  # bf16, float32
    serial = sum(gathers) + sum(gathers[:-1]) + sum(reductions)  # 5.11 s
    for mbs in (1, 2, 4):
        plan = build_plan(m, cluster_name=h100.name, device=h100.device.name, nodes=4, devices_per_node=8,
                          global_batch=64 * mbs, micro_batch=2, seq_len=8192, zero=3)
        assert plan.pipeline.micro_batches == mbs
        step = estimate(plan, h100).step_time_s
        assert mbs * serial <= step < mbs * (serial + gathers[-1]), mbs  # the head's gather is 0.09 s


def test_without_a_pipeline_one_micro_batch_is_held_at_a_time():
    # gradient accumulation runs forward and backward of each micro-batch in turn
    assert peak_in_flight("gpipe", 1, 1, 8, 0) == 1
    tl = simulate("1f1b", 1, 1, 4, [StageTimes(1.0, 2.0)])
    assert tl.step_time_s == 12.0 and tl.bubble_fraction() == 0.0


def test_without_overlap_every_grad_sync_waits_for_the_whole_backward():
    # interleaved 1F1B, p=2, v=2: each chunk's sync (0.5) overlaps the rank's remaining backward when
    # overlapped; otherwise both run back to back after the rank's last operation
    st = [StageTimes(1.0, 2.0, grad_sync_s=0.5) for _ in range(4)]
    on = simulate("interleaved-1f1b", 2, 2, 4, st, p2p=False)
    off = simulate("interleaved-1f1b", 2, 2, 4, st, p2p=False, overlap_grad_reduce=False)
    assert off.compute_end_s == on.compute_end_s
    for r in range(2):
        assert off.end_s[r] == pytest.approx(off.compute_end_s[r] + 2 * 0.5)
    assert on.step_time_s < off.step_time_s


@pytest.mark.parametrize("p,m", [(2, 2), (4, 8), (3, 5)])
def test_lockstep_without_transfers_matches_1f1b(p, m):
    # DeepSpeed's TrainSchedule: a blocking exchange only waits for the partner, which with free
    # transfers costs nothing beyond 1F1B's own dependencies
    st = [StageTimes(1.0, 2.0) for _ in range(p)]
    free = simulate("1f1b", p, 1, m, st, p2p=False)
    lock = simulate("1f1b", p, 1, m, st, p2p=False, lockstep=True)
    assert lock.step_time_s == pytest.approx(free.step_time_s)
    # its first stage runs p forwards before the first backward (Megatron's 1F1B: p - 1)
    kinds = [o.kind for o in lock.ops[0]]
    assert kinds.index("B") == min(p, m)


def test_lockstep_transfers_hold_both_ranks():
    # p=2, m=1, F=1, B=2, transfers 0.5: rank 0 F [0,1]; the activation exchange runs [1,1.5] on both;
    # rank 1 F [1.5,2.5], B [2.5,4.5]; the gradient exchange [4.5,5]; rank 0 B [5,7]
    st = [StageTimes(1, 2, send_fwd_s=0.5, send_bwd_s=0.5) for _ in range(2)]
    tl = simulate("1f1b", 2, 1, 1, st, lockstep=True)
    assert [(o.kind, o.start_s, o.end_s) for o in tl.ops[0]] == [("F", 0, 1), ("B", 5, 7)]
    assert [(o.kind, o.start_s, o.end_s) for o in tl.ops[1]] == [("F", 1.5, 2.5), ("B", 2.5, 4.5)]
    assert tl.step_time_s == pytest.approx(7.0)


# ------------------------------------------------------------------ devices sharing compute
def test_shared_compute_hand_computed_gpipe():
    # F = B = 1 measured with 2 processes busy on 1 slot: full-speed work 0.5 each. GPipe, 2 stages,
    # 2 micro-batches, no transfers. rank 0 F0 alone [0, .5]; rank 0 F1 and rank 1 F0 together at
    # rate 1/2 [.5, 1.5]; rank 1 F1 alone [1.5, 2]; rank 1 B0 alone [2, 2.5]; rank 1 B1 and rank 0 B0
    # together [2.5, 3.5]; rank 0 B1 alone [3.5, 4]. With one slot and a rank always busy, the step
    # is the total work (8 x 0.5).
    st = [StageTimes(1.0, 1.0) for _ in range(2)]
    tl = simulate("gpipe", 2, 1, 2, st, p2p=False, sharing=Sharing(1.0, 1, 2.0))
    assert [(o.kind, o.micro_batch) for o in tl.ops[0]] == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    assert [(o.kind, o.micro_batch) for o in tl.ops[1]] == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    assert [t for o in tl.ops[0] for t in (o.start_s, o.end_s)] == pytest.approx([0, .5, .5, 1.5, 2.5, 3.5, 3.5, 4])
    assert [t for o in tl.ops[1] for t in (o.start_s, o.end_s)] == pytest.approx([.5, 1.5, 1.5, 2, 2, 2.5, 2.5, 3.5])
    assert tl.step_time_s == pytest.approx(4.0)
    assert simulate("gpipe", 2, 1, 2, st, p2p=False).step_time_s == pytest.approx(6.0)  # no sharing


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2)])
def test_shared_compute_with_as_many_slots_as_processes_changes_nothing(schedule, v):
    st = [StageTimes(1.0 + s / 10, 2.0, send_fwd_s=0.3, send_bwd_s=0.2) for s in range(2 * v)]
    plain = simulate(schedule, 2, v, 4, st)
    shared = simulate(schedule, 2, v, 4, st, sharing=Sharing(4.0, 2, 4.0))
    assert shared.step_time_s == pytest.approx(plain.step_time_s)
    assert [t for o in shared.ops[1] for t in (o.start_s, o.end_s)] == \
        pytest.approx([t for o in plain.ops[1] for t in (o.start_s, o.end_s)])


def test_shared_compute_without_a_pipeline_keeps_times_measured_with_everyone_busy():
    st = [StageTimes(1.0, 2.0)]
    # 4 processes, 2 slots, measured with all 4 busy: every operation runs with all 4 busy again
    tl = simulate("1f1b", 1, 1, 3, st, sharing=Sharing.of(2.0, 4, 4, 4))
    assert tl.step_time_s == pytest.approx(9.0)
    assert Sharing.of(None, 4, 4) is None and Sharing.of(4.0, 4, 1) is None
    # one process alone on those 2 slots, priced from the same times: at full speed, 2 / 4 of them
    # (it was priced at the times themselves, 2x slow, where the world fitted the slots)
    alone = simulate("1f1b", 1, 1, 3, st, sharing=Sharing.of(2.0, 1, 1, 4))
    assert alone.step_time_s == pytest.approx(9.0 * 2 / 4)
    assert Sharing.of(2.0, 2, 1, 2) is None  # measured as it runs: nothing to scale


@pytest.mark.parametrize("p", [2, 3, 4, 6])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 12])
def test_zbv_order_is_torchs(p, m):
    """The planner's ZB-V order (written from Qi et al. 2024, section 6) is the one torch's
    ScheduleZBVZeroBubble executes, rank by rank (its order needs no process group to compute)."""
    from torch.distributed.pipelining import ScheduleZBVZeroBubble
    sched = object.__new__(ScheduleZBVZeroBubble)
    sched.pp_group_size, sched.num_stages, sched._n_microbatches = p, 2 * p, m
    for r in range(p):
        theirs = [(a.computation_type.value, a.stage_index, a.microbatch_index)
                  for a in sched._calculate_single_rank_operations(r) if a is not None]
        assert rank_order("zbv", p, 2, m, r) == theirs


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16)])
def test_zbv_fills_the_bubble_when_forward_input_and_weight_gradients_take_as_long(p, m):
    """ZB-V's claim (Qi et al. 2024, section 6): with F = I = W the weight gradients fill its
    bubbles; what is left is the V's first leg filling (the last rank waits for p - 1 chunk
    forwards), where 1F1B keeps p - 1 whole forward-backward slots and interleaving with two
    chunks half of that."""
    chunk = [StageTimes(0.5, 1.0, bwd_weight_s=0.5) for _ in range(2 * p)]
    zbv = simulate("zbv", p, 2, m, chunk, p2p=False).step_time_s
    inter = simulate("interleaved-1f1b", p, 2, m, chunk, p2p=False).step_time_s
    plain = simulate("1f1b", p, 1, m, [StageTimes(1.0, 2.0, bwd_weight_s=1.0) for _ in range(p)], p2p=False).step_time_s
    ideal = 3.0 * m
    assert zbv == pytest.approx(ideal + 0.5 * (p - 1))
    assert zbv < inter < plain == pytest.approx(ideal + 3.0 * (p - 1))
    tl = simulate("zbv", p, 2, m, chunk, p2p=False)
    assert sorted((o.kind, o.stage, o.micro_batch) for r in tl.ops for o in r) == sorted(
        (k, s, j) for k in "FIW" for s in range(2 * p) for j in range(m))


def test_zbv_holds_activations_until_the_weight_gradient():
    """A stage's activations stay from its F to its W (the weight gradients need the layer
    inputs), and what the weights' gradients start from from its I to its W."""
    p, m = 2, 4
    acts = {s: 1.0 for s in range(4)}
    assert peak_in_flight("zbv", p, 2, m, 0, acts) == max(
        _held(rank_order("zbv", p, 2, m, 0), acts, {s: 0.0 for s in range(4)}))
    with_grads = peak_in_flight("zbv", p, 2, m, 0, acts, {s: 0.25 for s in range(4)})
    assert with_grads == max(_held(rank_order("zbv", p, 2, m, 0), acts, {s: 0.25 for s in range(4)}))
    assert with_grads > peak_in_flight("zbv", p, 2, m, 0, acts)


def _held(order, acts, grads):
    held, out = 0.0, []
    for kind, s, _ in order:
        held += {"F": acts[s], "I": grads[s], "W": -acts[s] - grads[s]}[kind]
        out.append(held)
    return out


def test_a_chunk_has_gradients_from_its_first_backward_on():
    """Interleaved 1F1B, p = 2, v = 2, m = 2, rank 0 (stages 0 and 2): four forwards (chunk 0's
    two micro-batches, then chunk 1's), then the backwards, chunk 1's first. Chunk 1's gradients
    appear with 4 micro-batches in flight, chunk 0's with 2: large gradients peak at chunk 0's
    first backward (2 in flight beside both chunks'), small ones at chunk 1's (4 beside its own),
    where counting every gradient beside the most in flight would give 4 + both."""
    acts = {0: 1.0, 2: 1.0}
    assert [(k, s) for k, s, _ in rank_order("interleaved-1f1b", 2, 2, 2, 0)] == [
        ("F", 0), ("F", 0), ("F", 2), ("F", 2), ("B", 2), ("B", 2), ("B", 0), ("B", 0)]
    assert peak_with_gradients("interleaved-1f1b", 2, 2, 2, 0, acts, None, {0: 10.0, 2: 10.0}) == (2.0, 20.0)
    assert peak_with_gradients("interleaved-1f1b", 2, 2, 2, 0, acts, None, {0: 0.5, 2: 0.5}) == (4.0, 0.5)
    # with many micro-batches every chunk has its gradients before the most are in flight again
    p, m = 2, 8
    most = peak_in_flight("interleaved-1f1b", p, 2, m, 0, acts)
    assert peak_with_gradients("interleaved-1f1b", p, 2, m, 0, acts, None, {0: 0.5, 2: 0.5}) == (most, 1.0)
    # under ZB-V's split backward a chunk's gradients come with its first W: rank 0 runs F0 F0 F3
    # I3 W3 F3 I3 W3 I0 W0 I0 W0 (stages 0 and 3), so stage 3's appear with 3 forwards held and
    # stage 0's with its own 2
    assert [k + str(s) for k, s, _ in rank_order("zbv", 2, 2, 2, 0)] == "F0 F0 F3 I3 W3 F3 I3 W3 I0 W0 I0 W0".split()
    acts4 = {s: 1.0 for s in range(4)}
    assert peak_with_gradients("zbv", 2, 2, 2, 0, acts4, None, {s: 100.0 for s in range(4)}) == (2.0, 200.0)
    assert peak_with_gradients("zbv", 2, 2, 2, 0, acts4, None, {s: 0.1 for s in range(4)}) == (3.0, 0.1)


def test_every_pipeline_rank_steps_after_the_last_backward():
    """The gradient norm is summed over the pipeline ranks before the optimizer step
    (runtime.optim.clip_grad_norm): the rank with the most parameters to update cannot step while
    the first rank still drains the last backward, so the step is the last rank's end plus the
    slowest optimizer step, not the largest of each rank's end plus its own step."""
    from planner.cost import estimate
    from planner.plan import Stage
    from test_cost import A100, plan_for
    stages = [Stage(layers=[0, 5], zero=0, recompute=["none"] * 5, sequence_parallel=False),
              Stage(layers=[5, 34], zero=0, recompute=["none"] * 29, sequence_parallel=False)]
    plan = plan_for(dpn=2, pp=2, global_batch=8, stages=stages)
    est = estimate(plan, A100, keep_timeline=True, profile_extras=False)
    ends, opts = est.timeline.end_s, est.breakdown["optimizer_per_pp_rank_s"]
    assert ends[0] > ends[1] and opts[1] > 2 * opts[0]  # the first rank ends last, the second steps longest
    assert est.step_time_s == pytest.approx(max(ends) + max(opts), rel=1e-9)
    assert est.step_time_s > max(e + o for e, o in zip(ends, opts)) * (1 + 1e-6)
    t = est.breakdown["time"]
    assert t["critical_pp_rank"] == 0 and t["optimizer_s"] == pytest.approx(opts[1])
    # what the second rank waits for, which compare shows beside the run's
    assert est.breakdown["optimizer_wait_per_pp_rank_s"] == pytest.approx([0.0, ends[0] - ends[1]])
