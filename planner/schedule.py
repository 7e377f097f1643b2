"""Pipeline schedules played as events: step time, bubble, activations in flight, the timeline.

Each pipeline rank executes its forward (F) and backward (B) operations in the fixed order its
schedule prescribes; an operation starts when the rank is free and its inputs have arrived:
F of stage s on micro-batch j needs F of stage s-1 on j plus the point-to-point transfer, B of
stage s needs B of stage s+1 plus the transfer back, and its own F. A rank waits for its sends to complete (see simulate). The
step time falls out of playing this, not from a bubble formula; with equal stages and free
transfers it reproduces the closed forms (GPipe and 1F1B bubble (p-1)/(m+p-1), Huang et al.
2019 and Narayanan et al. 2019; interleaved (p-1)/(v m) of the ideal time, Narayanan et al. SC'21).

Orders follow Megatron-LM and torch.distributed.pipelining: 1F1B warms up with p-r-1 forwards
on rank r; interleaved 1F1B warms up with 2(p-r-1) + (v-1)p forwards and walks model chunks in
groups of p micro-batches (so it needs m to be a multiple of p). With v chunks per rank, chunk c
of rank r is stage c*p + r.

Gradient synchronisation of a stage's data-parallel group starts when that stage's last
backward finishes and runs on the rank's communication stream, overlapping whatever backward
work the rank still has.
"""
from __future__ import annotations

from dataclasses import dataclass, field

BLOCKING_P2P = True  # ranks wait for their own pipeline sends (see simulate)


@dataclass
class StageTimes:
    """Per micro-batch times of one pipeline stage (model chunk)."""
    fwd_s: float
    bwd_s: float
    send_fwd_s: float = 0.0  # transfer of this stage's output to the next stage
    send_bwd_s: float = 0.0  # transfer of this stage's input gradient to the previous stage
    grad_sync_s: float = 0.0  # data-parallel gradient communication after its last backward


@dataclass
class Op:
    kind: str  # "F" or "B"
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

    @property
    def step_time_s(self) -> float:
        return max(self.end_s)

    @property
    def critical_rank(self) -> int:
        return max(range(self.pp), key=lambda r: (self.end_s[r], -r))

    def bubble_fraction(self) -> float:
        r = self.critical_rank
        return 1.0 - self.busy_s[r] / self.compute_end_s[r] if self.compute_end_s[r] > 0 else 0.0


def rank_order(schedule: str, pp: int, virtual_stages: int, micro_batches: int, rank: int) -> list[tuple[str, int, int]]:
    """The (kind, stage, micro_batch) operations rank `rank` executes, in order."""
    p, v, m = pp, virtual_stages, micro_batches
    if p == 1:  # no pipeline: each micro-batch runs forward then backward (gradient accumulation)
        return [x for j in range(m) for x in (("F", 0, j), ("B", 0, j))]
    if schedule == "gpipe":
        stages = [c * p + rank for c in range(v)]
        order = [("F", s, j) for s in stages for j in range(m)]
        return order + [("B", s, j) for s in reversed(stages) for j in range(m)]
    if schedule == "1f1b" and v == 1:
        warm = min(p - rank - 1, m)
        order = [("F", rank, j) for j in range(warm)]
        for i in range(m - warm):
            order += [("F", rank, warm + i), ("B", rank, i)]
        return order + [("B", rank, j) for j in range(m - warm, m)]
    if schedule != "interleaved-1f1b":
        raise ValueError(f"schedule {schedule!r} with {v} virtual stages")
    if m % p:
        raise ValueError(f"interleaved 1F1B needs micro_batches ({m}) to be a multiple of pp ({p})")
    total = m * v

    def op(kind, k):
        in_group = k % (p * v)
        chunk = in_group // p
        if kind == "B":
            chunk = v - 1 - chunk
        mb = (k // (p * v)) * p + k % p
        return (kind, chunk * p + rank, mb)

    warm = min((p - rank - 1) * 2 + (v - 1) * p, total)
    order = [op("F", k) for k in range(warm)]
    for i in range(total - warm):
        order += [op("F", warm + i), op("B", i)]
    return order + [op("B", k) for k in range(total - warm, total)]


def simulate(schedule: str, pp: int, virtual_stages: int, micro_batches: int,
             stages: list[StageTimes], p2p: bool = True, blocking_p2p: bool = BLOCKING_P2P) -> Timeline:
    """Play the schedule; `stages` has pp * virtual_stages entries in model order. With
    `blocking_p2p` a rank waits for its own send to complete before its next operation, as
    torch.distributed.pipelining (which waits on batched send/recv work), Megatron-LM and DeepSpeed
    do; otherwise sends run in the background and only the receiver waits."""
    n_stages = pp * virtual_stages
    if len(stages) != n_stages:
        raise ValueError(f"{len(stages)} stage times for {n_stages} stages")
    orders = [rank_order(schedule, pp, virtual_stages, micro_batches, r) for r in range(pp)]
    done: dict[tuple[str, int, int], float] = {}
    pos = [0] * pp
    free = [0.0] * pp
    ops: list[list[Op]] = [[] for _ in range(pp)]
    last = n_stages - 1
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(pp):
            while pos[r] < len(orders[r]):
                kind, s, j = orders[r][pos[r]]
                if kind == "F":
                    dep = ("F", s - 1, j) if s > 0 else None
                    lag = stages[s - 1].send_fwd_s if (s > 0 and p2p) else 0.0
                else:
                    dep = ("B", s + 1, j) if s < last else ("F", s, j)
                    lag = stages[s + 1].send_bwd_s if (s < last and p2p) else 0.0
                if dep is not None and dep not in done:
                    break
                ready = done[dep] + lag if dep is not None else 0.0
                start = max(free[r], ready)
                dur = stages[s].fwd_s if kind == "F" else stages[s].bwd_s
                end_op = start + dur
                done[(kind, s, j)] = end_op
                ops[r].append(Op(kind, s, j, start, end_op))
                free[r] = end_op
                if p2p and blocking_p2p:  # the rank waits for its send to complete
                    free[r] += stages[s].send_fwd_s if (kind == "F" and s < last) else 0.0
                    free[r] += stages[s].send_bwd_s if (kind == "B" and s > 0) else 0.0
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {schedule} deadlocked (pp={pp}, v={virtual_stages}, m={micro_batches})")
    end, comm = [], []
    for r in range(pp):
        comm_free, intervals = 0.0, []
        last_b = {}
        for o in ops[r]:
            if o.kind == "B":
                last_b[o.stage] = max(last_b.get(o.stage, 0.0), o.end_s)
        for s, t in sorted(last_b.items(), key=lambda kv: kv[1]):
            if stages[s].grad_sync_s > 0:
                start = max(comm_free, t)
                comm_free = start + stages[s].grad_sync_s
                intervals.append((s, start, comm_free))
        comm.append(intervals)
        end.append(max(free[r], comm_free))
    busy = [sum(o.end_s - o.start_s for o in ops[r]) for r in range(pp)]
    return Timeline(pp, virtual_stages, micro_batches, ops, free, end, busy, comm)


def peak_in_flight(schedule: str, pp: int, virtual_stages: int, micro_batches: int, rank: int,
                   weights: dict | None = None) -> float:
    """Most activation weight rank `rank` holds at once: the sum of weights[stage] over forwards
    whose backward has not run yet (a weight of 1 per stage counts micro-batches)."""
    held = peak = 0.0
    for kind, s, _ in rank_order(schedule, pp, virtual_stages, micro_batches, rank):
        w = 1.0 if weights is None else weights[s]
        if kind == "F":
            held += w
            peak = max(peak, held)
        else:
            held -= w
    return peak
