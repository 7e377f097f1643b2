"""Pipeline schedules played as events: step time, bubble, the timeline.

Each pipeline rank executes its forward (F) and backward (B) operations in the fixed order its
schedule prescribes; an operation starts when the rank is free and its inputs have arrived:
F of stage s on micro-batch j needs F of stage s-1 on j plus the point-to-point transfer, B of
stage s needs B of stage s+1 plus the transfer back, and its own F. A rank waits for its sends to complete (see simulate). The
step time falls out of playing this, not from a bubble formula; with equal stages and free
transfers it reproduces the closed forms (GPipe and 1F1B bubble (p-1)/(m+p-1), Huang et al.
2019 and Narayanan et al. 2019; interleaved (p-1)/(v m) of the ideal time, Narayanan et al. SC'21).
Each rank's order of operations, and what it holds in flight: planner.orders.

Gradient synchronisation of a stage's data-parallel group starts when that stage's last
backward finishes and runs on the rank's communication stream, overlapping whatever backward
work the rank still has; where the stage gives it in parts (StageTimes.grad_sync_parts), each part
starts once that much of the stage's last backward is done and the stream is free. While a part
runs beside that backward, the backward computes at 1 - `steal` of its rate (planner.comm.
overlap_steal: the collective's kernels share the device), so it ends later, and so does every
operation waiting for it (beside_backward); a part that runs beside the rank's later operations
(another chunk's, under interleaving) delays the rank's end by the same share of their overlap.
With
`overlap_grad_reduce=False` every stage's reduction waits for the rank's whole backward, as
Megatron-LM v2.x's local DDP (`allreduce_gradients()` called from `train_step` after
`forward_backward_func`, megatron/training.py at tag v2.5) and DeepSpeed's pipeline engine
(`ReduceGrads` issued after the last step of `TrainSchedule`) do.

Devices that share compute (`sharing`: processes on shared CPU cores, ClusterSpec.compute_slots)
run an operation at rate min(1, slots / busy processes): a rank's F or B is work that the rank
does at full speed while at most `slots` processes compute, and proportionally slower beyond
(processor sharing, as the OS scheduler time-slices runnable processes). A pipeline rank is the
tp x dp processes that run its stage together; ranks waiting on a transfer do not compute. The
given operation times were measured with `measured_busy` processes computing at once. Lock-step
execution (a DeepSpeed replay for GPU clusters) does not share.

Lock-step execution (`lockstep=True`, 1F1B only) plays DeepSpeed's PipelineEngine (deepspeed/
runtime/pipe/schedule.py `TrainSchedule` and p2p.py, v0.5.8): 2(m+p-1) steps; at each step a
stage runs one forward or one backward chosen by the parities of the step and the stage, after
exchanging activations and gradients with its neighbours by blocking send/recv (broadcasts over
2-rank groups before torch 1.8). A blocking exchange starts only when both ranks reach it, so
neighbours move together and a forward step waits for the neighbour's backward step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from planner.orders import rank_order

BLOCKING_P2P = True  # ranks wait for their own pipeline sends (see simulate)


@dataclass
class StageTimes:
    """Per micro-batch times of one pipeline stage (model chunk)."""
    fwd_s: float
    bwd_s: float  # the whole backward; schedules that split it run bwd_s - bwd_weight_s as I, the rest as W
    send_fwd_s: float = 0.0  # transfer of this stage's output to the next stage
    send_bwd_s: float = 0.0  # transfer of this stage's input gradient to the previous stage
    grad_sync_s: float = 0.0  # data-parallel gradient communication after its last backward
    bwd_weight_s: float = 0.0  # the part of bwd_s that computes the weight gradients
    # where that communication runs beside the last backward (planner.comm.reduce_beside_backward):
    # its parts in the order issued, each (fraction of that backward done when its gradients are
    # complete, seconds)
    grad_sync_parts: tuple = ()
    # ZeRO 3's parameter all-gathers of that last backward, on the same communicator as its parts
    # (beside_backward's `gathers`), and the seconds of bwd_s that price ZeRO 2/3's communication
    # beside a backward (planner.comm.exposed_beside; 0 where the last backward plays nothing),
    # which the last backward plays with its parts instead
    bwd_gathers: tuple = ()
    bwd_gather_s: float = 0.0

    def duration(self, kind: str) -> float:
        """Seconds of operation `kind`: F, B (the whole backward), I (input gradient) or W (weights)."""
        if kind == "F":
            return self.fwd_s
        if kind == "W":
            return self.bwd_weight_s
        return self.bwd_s - self.bwd_weight_s if kind == "I" else self.bwd_s


def beside_backward(work: float, parts, steal: float, busy_until: float = 0.0, gathers=()) -> tuple[float, list]:
    """A stage's last backward of `work` seconds alone with its gradient reduction's parts beside it
    ((fraction of the backward done when the part's gradients are complete, seconds) in the order
    issued; StageTimes.grad_sync_parts) on a communication stream busy until `busy_until`: the
    backward runs at 1 - `steal` of its rate while the stream is busy. Returns (the seconds the
    backward takes, [(begin, end) of each part]), from the backward's start.

    `gathers`: ZeRO 3's parameter all-gathers of that backward, (fraction of the backward done
    where a layer's backward starts and needs its parameters, seconds), in the order needed. They
    share the parts' stream: FSDP2 issues its all-gathers and reduce-scatters on the one shard
    group, one NCCL communicator, which runs one collective at a time in the order issued
    (pytorch/pytorch#186335, 2026: "serializes them on the wire"; #64803 and #70235 for FSDP1).
    Each layer's pre-backward hook waits for its own gather and then issues the next layer's
    (FSDP2's backward prefetch, one layer ahead); its post-backward hook issues its reduce-scatter,
    so a gather queues behind the reduction of the layer before. The backward idles at a layer
    whose gather has not ended."""
    slow = 1.0 - steal
    now = done = 0.0  # the backward's time and the work it has done by then
    comm, pieces = busy_until, []

    def reach(target):  # when the backward has done `target` of its work
        nonlocal now, done
        if now < comm and target > done:  # the stream is busy from now until comm
            more = slow * (comm - now)
            if done + more >= target:
                now, done = now + (target - done) / slow, target
                return now
            now, done = comm, done + more
        now, done = now + max(0.0, target - done), max(done, target)
        return now

    ends = []  # each gather's end, as issued

    def issue(k):  # the gathers up to the k-th, at the backward's time now
        nonlocal comm
        while len(ends) <= min(k, len(gathers) - 1):
            comm = max(comm, now) + gathers[len(ends)][1]
            ends.append(comm)
    # at one fraction: the layer before's reduction, then the layer's wait for its gather, then the next one's issue
    events = sorted([(min(f, 1.0), 0, i) for i, (f, _) in enumerate(parts)]
                    + [(min(f, 1.0), 1, k) for k, (f, _) in enumerate(gathers)])
    issue(0)
    for frac, kind, i in events:
        reach(frac * work)
        if kind == 0:
            begin = max(comm, now)
            comm = begin + parts[i][1]
            pieces.append((begin, comm))
        else:
            issue(i)
            now = max(now, ends[i])  # idle until its parameters are gathered
            issue(i + 1)
    return reach(work), pieces


@dataclass(frozen=True)
class Sharing:
    """Processes sharing `slots` compute units (see the module doc)."""
    slots: float
    procs_per_rank: int  # processes computing together for one pipeline rank (tp x dp)
    measured_busy: float = 1.0  # processes that computed at once when the op times were measured

    @staticmethod
    def of(slots, world: int, procs_per_rank: int, measured_busy: float = 1.0) -> "Sharing | None":
        """The sharing of a world of `world` processes on `slots` compute units; None where every
        process has its own (slots None or >= world) and the times were measured so (measured_busy
        at most slots: else they are scaled down to full speed, as a one-process plan priced from
        a profile measured by four processes on two cores runs)."""
        if slots is None or (slots >= world and measured_busy <= slots):
            return None
        return Sharing(float(slots), procs_per_rank, float(measured_busy))

    def work(self, seconds: float) -> float:
        """Full-speed work of an operation timed at `measured_busy` busy processes."""
        return seconds / max(1.0, self.measured_busy / self.slots)

    def rate(self, busy_ranks: int) -> float:
        return min(1.0, self.slots / max(1, busy_ranks * self.procs_per_rank))


@dataclass
class Op:
    kind: str  # "F", "B", or a split backward's "I" and "W"
    stage: int
    micro_batch: int
    start_s: float = 0.0
    end_s: float = 0.0


@dataclass
class Timeline:
    pp: int
    virtual_stages: int
    micro_batches: int
    ops: list  # per rank: list of Op in execution order, with start and end
    compute_end_s: list  # per rank: end of its last F/B
    end_s: list  # per rank: end including gradient synchronisation
    busy_s: list  # per rank: sum of F and B durations
    comm_intervals: list = field(default_factory=list)  # per rank: [(stage, start, end)] of grad sync
    # per rank: what the reductions beside its stages' last backwards added to them (beside_backward;
    # in compute_end_s; what they add beside its later operations is in end_s only)
    slowed_s: list = field(default_factory=list)

    @property
    def step_time_s(self) -> float:
        return max(self.end_s)

    @property
    def critical_rank(self) -> int:
        return max(range(self.pp), key=lambda r: (self.end_s[r], -r))

    def bubble_fraction(self) -> float:
        r = self.critical_rank
        return 1.0 - self.busy_s[r] / self.compute_end_s[r] if self.compute_end_s[r] > 0 else 0.0


def simulate(schedule: str, pp: int, virtual_stages: int, micro_batches: int,
             stages: list[StageTimes], p2p: bool = True, blocking_p2p: bool = BLOCKING_P2P,
             overlap_grad_reduce: bool = True, lockstep: bool = False, sharing: Sharing | None = None,
             steal: float = 0.0) -> Timeline:
    """Play the schedule; `stages` has pp * virtual_stages entries in model order. With
    `blocking_p2p` a rank waits for its own send to complete before its next operation, as
    torch.distributed.pipelining (which waits on batched send/recv work), Megatron-LM and DeepSpeed
    do; otherwise sends run in the background and only the receiver waits. `overlap_grad_reduce`
    `lockstep`, `sharing` and `steal`: see the module doc."""
    n_stages = pp * virtual_stages
    if len(stages) != n_stages:
        raise ValueError(f"{len(stages)} stage times for {n_stages} stages")
    if lockstep and pp > 1:
        if schedule != "1f1b" or virtual_stages != 1:
            raise ValueError(f"lock-step execution plays 1F1B without interleaving, not {schedule} v={virtual_stages}")
        from planner.lockstep import play_lockstep
        ops, free = play_lockstep(pp, micro_batches, stages, p2p)  # its backwards are not slowed
        return _finish(pp, virtual_stages, micro_batches, stages, ops, free, overlap_grad_reduce)
    orders = [rank_order(schedule, pp, virtual_stages, micro_batches, r) for r in range(pp)]
    if sharing is not None:
        from planner.shared_play import play_shared
        ops, free = play_shared(orders, stages, p2p, blocking_p2p, sharing)  # nor these (CPU processes)
        return _finish(pp, virtual_stages, micro_batches, stages, ops, free, overlap_grad_reduce)
    slowed = _slowed_last_backward(orders, stages, micro_batches, overlap_grad_reduce, steal)
    plays = prepared_ops(orders, stages, p2p, blocking_p2p, slowed)
    done: dict[tuple[str, int, int], float] = {}
    pos = [0] * pp
    free = [0.0] * pp
    times: list[list] = [[] for _ in range(pp)]  # per rank: (start, end) of each operation played
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(pp):
            i, now, play, out = pos[r], free[r], plays[r], times[r]
            while i < len(play):
                key, dep, lag, dur, send = play[i]
                if dep is not None:
                    ready = done.get(dep)
                    if ready is None:
                        break
                    ready += lag
                    if ready > now:  # max(now, ready + lag), inline
                        now = ready
                end_op = now + dur
                done[key] = end_op
                out.append((now, end_op))
                now = end_op + send
                i += 1
            if i > pos[r]:
                remaining -= i - pos[r]
                pos[r], free[r], progressed = i, now, True
        if not progressed:
            raise RuntimeError(f"schedule {schedule} deadlocked (pp={pp}, v={virtual_stages}, m={micro_batches})")
    ops = [[Op(*op, start, end) for op, (start, end) in zip(order, t)] for order, t in zip(orders, times)]
    return _finish(pp, virtual_stages, micro_batches, stages, ops, free, overlap_grad_reduce, steal, slowed)


def _slowed_last_backward(orders, stages: list, micro_batches: int, overlap_grad_reduce: bool, steal: float) -> dict:
    """{operation: seconds added}: each stage's last backward (its last micro-batch's B, or W under a
    split backward), slowed by the parts of its reduction that run beside it (beside_backward)."""
    if not (overlap_grad_reduce and (steal > 0 or any(st.bwd_gathers or st.bwd_gather_s for st in stages))):
        return {}
    kind = "W" if any(op[0] == "W" for order in orders for op in order) else "B"
    out = {}
    for s, st in enumerate(stages):
        if st.grad_sync_s > 0 and st.grad_sync_parts and (steal > 0 or st.bwd_gathers or st.bwd_gather_s):
            work = st.duration(kind)
            out[(kind, s, micro_batches - 1)] = beside_backward(work - st.bwd_gather_s, st.grad_sync_parts, steal,
                                                                gathers=st.bwd_gathers)[0] - work
    return out


def prepared_ops(orders, stages: list, p2p: bool, blocking_p2p: bool, slowed: dict | None = None) -> list:
    """Per rank, its operations as (key, dependency, transfer lag, duration, own send): a forward
    needs the previous stage's, a backward (B, or a split one's I) the next stage's, a W its own
    stage's I; a forward sends its output on, a backward (B or I) its input gradient back, a W
    nothing (a step plays thousands: computed once). `slowed`: seconds added to some operations."""
    last = len(stages) - 1
    dur = [{kind: x.duration(kind) for kind in "FBIW"} for x in stages]
    fwd_lag = [x.send_fwd_s if p2p else 0.0 for x in stages]
    bwd_lag = [x.send_bwd_s if p2p else 0.0 for x in stages]
    sends = [{"F": x.send_fwd_s if s < last else 0.0, "W": 0.0, "B": x.send_bwd_s if s > 0 else 0.0,
              "I": x.send_bwd_s if s > 0 else 0.0} if p2p and blocking_p2p else dict.fromkeys("FWBI", 0.0)
             for s, x in enumerate(stages)]
    plays = []
    for order in orders:
        play = []
        for op in order:
            kind, s, j = op
            if kind == "F":
                dep, lag = (("F", s - 1, j), fwd_lag[s - 1]) if s > 0 else (None, 0.0)
            elif kind == "W":
                dep, lag = ("I", s, j), 0.0
            elif s < last:
                dep, lag = (kind, s + 1, j), bwd_lag[s + 1]
            else:
                dep, lag = ("F", s, j), 0.0
            play.append((op, dep, lag, dur[s][kind] + (slowed.get(op, 0.0) if slowed else 0.0), sends[s][kind]))
        plays.append(play)
    return plays


def _finish(pp, virtual_stages, micro_batches, stages, ops, free, overlap_grad_reduce, steal=0.0,
            slowed=None) -> Timeline:
    """Add each rank's gradient synchronisation after its operations and build the Timeline."""
    end, comm, slowed_by_rank = [], [], []
    slowed = slowed or {}
    for r in range(pp):
        comm_free, intervals, later = 0.0, [], 0.0
        last_b = {}
        for i, o in enumerate(ops[r]):
            if o.kind in ("B", "W") and (o.stage not in last_b or o.end_s >= last_b[o.stage][1].end_s):
                last_b[o.stage] = (i, o)  # a stage's gradients are complete after its last B (or W)
        for s, (i, o) in sorted(last_b.items(), key=lambda kv: kv[1][1].end_s):
            st = stages[s]
            if st.grad_sync_s <= 0:
                continue
            # its parts, each once its share of that backward is done (block by block beside it), or
            # the whole once that backward ends (without overlap: once the rank's whole backward ends)
            if overlap_grad_reduce and st.grad_sync_parts:
                t0 = o.start_s
                work = o.end_s - t0 - slowed.get((o.kind, o.stage, o.micro_batch), 0.0)
                _, pieces = beside_backward(work - st.bwd_gather_s, st.grad_sync_parts, steal,
                                            max(0.0, comm_free - t0), st.bwd_gathers)
                pieces = [(t0 + a, t0 + b) for a, b in pieces]
                if steal > 0 and pieces[-1][1] > o.end_s:  # beside the rank's later operations too
                    later += steal * _overlap(pieces, ops[r][i + 1:], o.end_s)
            else:
                t0 = o.end_s if overlap_grad_reduce else free[r]
                pieces = [(max(comm_free, t0), max(comm_free, t0) + st.grad_sync_s)]
            comm_free = pieces[-1][1]
            intervals.append((s, pieces[0][0], comm_free))
        comm.append(intervals)
        end.append(max(free[r] + later, comm_free))
        mine = {o.stage for o in ops[r]} if slowed else ()
        slowed_by_rank.append(sum(x for (_, s, _), x in slowed.items() if s in mine))
    busy = [sum(o.end_s - o.start_s for o in ops[r]) for r in range(pp)]
    return Timeline(pp, virtual_stages, micro_batches, ops, free, end, busy, comm, slowed_by_rank)


def _overlap(pieces, later_ops, since: float) -> float:
    """Seconds the communication `pieces` ((begin, end), in order) overlap the operations
    `later_ops` (in order, from `since` on)."""
    total, stop = 0.0, pieces[-1][1]
    for o in later_ops:
        if o.start_s >= stop:
            break
        a0, a1 = max(o.start_s, since), o.end_s
        for b, e in pieces:
            if e > a0 and b < a1:
                total += min(e, a1) - max(b, a0)
    return total
