"""Lock-step 1F1B: DeepSpeed's PipelineEngine (deepspeed/runtime/pipe/schedule.py `TrainSchedule`
and p2p.py, v0.5.8), for predicting published runs (planner.schedule.simulate with lockstep=True;
the module doc there says how it plays)."""
from __future__ import annotations

from planner.schedule import Op, StageTimes


def lockstep_commands(pp: int, micro_batches: int, rank: int) -> list[tuple]:
    """Rank `rank`'s commands under DeepSpeed's TrainSchedule (v0.5.8, deepspeed/runtime/pipe/
    schedule.py): ("recv"|"send", what, peer_stage, micro_batch) exchanges and ("F"|"B", stage,
    micro_batch) computations, step by step. Stage s runs forwards on steps of its own parity."""
    p, m, s = pp, micro_batches, rank
    valid = lambda j: 0 <= j < m  # noqa: E731
    cmds, prev = [], -1
    for step in range(2 * (m + p - 1)):
        forward = step % 2 == s % 2
        if forward:
            j = (step if step % 2 == 0 else step - 1) // 2 - s // 2
        elif step % 2 == 0:  # even step, odd stage: backward
            j = step // 2 - p + (s + 1) // 2
        else:  # odd step, even stage: backward
            j = (step - 1) // 2 - p + 1 + s // 2
        if forward:
            if valid(j) and s > 0:
                cmds.append(("recv", "act", s - 1, j))
            if valid(prev) and s > 0:
                cmds.append(("send", "grad", s - 1, prev))
        else:
            if valid(prev) and s < p - 1:
                cmds.append(("send", "act", s + 1, prev))
            if valid(j) and s < p - 1:
                cmds.append(("recv", "grad", s + 1, j))
        if valid(j):
            cmds.append(("F" if forward else "B", s, j))
        prev = j
    return cmds


def play_lockstep(pp: int, m: int, stages: list[StageTimes], p2p: bool):
    """Play lockstep_commands; a blocking exchange starts when both ranks have reached it and
    holds both until the transfer ends."""
    cmds = [lockstep_commands(pp, m, r) for r in range(pp)]
    pos, free = [0] * pp, [0.0] * pp
    ops: list[list[Op]] = [[] for _ in range(pp)]
    arrived: dict = {}  # exchange -> (rank, time) of the first rank to reach it
    finished: dict = {}  # exchange -> time the transfer ended
    remaining = sum(len(c) for c in cmds)
    while remaining:
        progressed = False
        for r in range(pp):
            while pos[r] < len(cmds[r]):
                c = cmds[r][pos[r]]
                if c[0] in ("F", "B"):
                    dur = stages[r].fwd_s if c[0] == "F" else stages[r].bwd_s
                    ops[r].append(Op(c[0], r, c[2], free[r], free[r] + dur))
                    free[r] += dur
                else:
                    direction, what, peer, j = c
                    src = r if direction == "send" else peer
                    key = (what, src, j)
                    if key in finished:  # the partner came second and ran the transfer
                        free[r] = finished.pop(key)
                    elif key in arrived and arrived[key][0] != r:  # the partner is waiting
                        size = stages[src].send_fwd_s if what == "act" else stages[src].send_bwd_s
                        finished[key] = max(arrived.pop(key)[1], free[r]) + (size if p2p else 0.0)
                        free[r] = finished[key]
                    else:  # wait for the partner
                        arrived.setdefault(key, (r, free[r]))
                        break
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"lock-step 1F1B deadlocked (pp={pp}, m={m})")
    return ops, free
