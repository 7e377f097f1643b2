"""Shared compute: the operations of pipeline ranks whose processes share fewer compute units than
there are of them, played in time under processor sharing (planner.schedule.simulate with
`sharing`; the module doc there says how)."""
from __future__ import annotations

from planner.schedule import Op, Sharing, prepared_ops


def play_shared(orders, stages, p2p, blocking_p2p, sharing: Sharing):
    """Play the orders in time, the running operations sharing compute (processor sharing):
    between two events every running operation advances at sharing.rate(running ranks)."""
    pp = len(orders)
    plays = prepared_ops(orders, stages, p2p, blocking_p2p)
    done: dict = {}
    pos, free = [0] * pp, [0.0] * pp
    ops: list[list[Op]] = [[] for _ in range(pp)]
    running: dict = {}  # rank -> [op key, remaining work, start]
    now, remaining = 0.0, sum(len(o) for o in orders)
    while remaining:
        wake = float("inf")
        for r in range(pp):
            if r in running or pos[r] == len(orders[r]):
                continue
            key, dep, lag, dur, _ = plays[r][pos[r]]
            if dep is not None and dep not in done:
                continue
            ready = max(free[r], done[dep] + lag if dep is not None else 0.0)
            if ready <= now:
                running[r] = [key, sharing.work(dur), now]
            else:
                wake = min(wake, ready)
        if not running and wake == float("inf"):
            raise RuntimeError(f"schedule deadlocked with shared compute (pp={pp})")
        rate = sharing.rate(len(running))
        step = min([rem / rate for _, rem, _ in running.values()] + [wake - now])
        now += step
        for r in list(running):
            key, rem, start = running[r]
            rem -= rate * step
            if rem > 1e-12 * max(1.0, now):
                running[r][1] = rem
                continue
            del running[r]
            kind, s, j = key
            done[key] = now
            ops[r].append(Op(kind, s, j, start, now))
            free[r] = now + plays[r][pos[r]][4]  # its own send
            pos[r] += 1
            remaining -= 1
    return ops, free
