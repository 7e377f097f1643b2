"""When a pipeline rank may let go of the input gradients it sends (planner.sends): the runtime
waits for each once word has come back that its receiver consumed it, so the rank holds a few, not
every micro-batch's, under torch's action runtime (interleaved 1F1B, ZB-V)."""
from __future__ import annotations

from collections import deque

import pytest

from planner.plan import stage_rank
from planner.orders import rank_order
from planner.sends import STEADY_ROUNDS, _unproven, delivery_proofs, unproven_sends

CASES = [("interleaved-1f1b", 2, 2, 4), ("interleaved-1f1b", 3, 2, 6), ("interleaved-1f1b", 4, 3, 8),
         ("zbv", 2, 2, 3), ("zbv", 3, 2, 7), ("zbv", 4, 2, 8)]


def _orders(schedule, p, v, m):
    return {r: rank_order(schedule, p, v, m, r) for r in range(p)}


def _happens_before(orders, rank_of, n):
    """Every action's set of actions that happened before it (program order and messages), by
    search over the graph: independent of the vector clocks under test."""
    node = {(r, i): a for r in orders for i, a in enumerate(orders[r])}
    at = {(r, a[0] if a[0] != "I" else "B", a[1], a[2]): (r, i) for (r, i), a in node.items()}
    preds = {k: [] for k in node}
    for (r, i), (kind, s, j) in node.items():
        if i:
            preds[r, i].append((r, i - 1))
        if kind == "F" and s > 0 and rank_of(s - 1) != r:
            preds[r, i].append(at[rank_of(s - 1), "F", s - 1, j])
        if kind in ("B", "I") and s < n - 1 and rank_of(s + 1) != r:
            preds[r, i].append(at[rank_of(s + 1), "B", s + 1, j])

    def before(k):
        seen, todo = set(), deque(preds[k])
        while todo:
            x = todo.popleft()
            if x not in seen:
                seen.add(x)
                todo.extend(preds[x])
        return seen
    return at, before


@pytest.mark.parametrize("schedule,p,v,m", CASES)
def test_a_send_is_let_go_only_after_its_receiver_consumed_it(schedule, p, v, m):
    """Each proof names a send its rank has posted, once, and the action that consumes it on the
    receiving rank happened before the action that lets it go (else the wait could block on a
    receiver still waiting for this rank: a hang)."""
    n = p * v
    rank_of = lambda s: stage_rank(schedule, p, s)  # noqa: E731
    orders = _orders(schedule, p, v, m)
    proofs = delivery_proofs(orders, rank_of, n)
    at, before = _happens_before(orders, rank_of, n)
    released = []
    for r, by_action in proofs.items():
        for action, sends in by_action.items():
            here = at[r, action[0] if action[0] != "I" else "B", action[1], action[2]]
            for s, j in sends:
                sent = at[r, "B", s, j]  # the backward that sent it
                consumed = at[rank_of(s - 1), "B", s - 1, j]
                assert sent in before(here) and consumed in before(here), (r, action, (s, j))
                released.append((s, j))
    assert len(released) == len(set(released))
    assert released, "no send is ever let go before the end of the step"


@pytest.mark.parametrize("schedule,p,v", [("interleaved-1f1b", 2, 2), ("interleaved-1f1b", 4, 2), ("zbv", 4, 2)])
def test_a_rank_holds_a_few_sends_however_many_micro_batches(schedule, p, v):
    """At most p unproven sends a stage (the distance word travels back), the same at 4p micro-batches
    as at 64p; the stages that send to no other rank (the first; ZB-V's turn) none."""
    few, many = unproven_sends(schedule, p, v, 4 * p), unproven_sends(schedule, p, v, 64 * p)
    assert few == many and max(many) <= p and many[0] == 0
    if schedule == "zbv":
        assert many[p] == 0


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (4, 3, 12)])
def test_interleaved_order_is_torchs(p, v, m):
    """The runtime finds its proofs in torch's own compute orders, the planner prices them from
    its own: the same for interleaved 1F1B (test_schedule.py checks ZB-V)."""
    from torch.distributed.pipelining import ScheduleInterleaved1F1B
    sched = object.__new__(ScheduleInterleaved1F1B)
    sched.pp_group_size, sched.n_local_stages, sched.number_of_rounds = p, v, m // p
    sched._n_microbatches, sched.microbatches_per_round, sched.rank = m, p, 0
    for r in range(p):
        sched.rank = r
        theirs = [(a.computation_type.value, a.stage_index, a.microbatch_index)
                  for a in sched._calculate_single_rank_operations(r) if a is not None]
        assert rank_order("interleaved-1f1b", p, v, m, r) == theirs


@pytest.mark.parametrize("schedule,v", [("interleaved-1f1b", 2), ("interleaved-1f1b", 3), ("zbv", 2)])
def test_past_a_few_rounds_of_micro_batches_the_most_held_stays(schedule, v):
    """unproven_sends prices more than STEADY_ROUNDS x pp micro-batches as that many: exact, for
    pp 2 to 8 and up to 24 x pp micro-batches."""
    for p in range(2, 9):
        steady = _unproven(schedule, p, v, STEADY_ROUNDS * p)  # at the rank's worst moment, and each stage's most
        odd = (2 * p + 1, 3 * p + 1, 5 * p + 1, 9 * p + 3) if schedule == "zbv" else ()  # ZB-V takes any number
        for m in (3 * p, 4 * p, 5 * p, 9 * p, 24 * p, *odd):
            assert _unproven(schedule, p, v, m) == steady, (p, m)


@pytest.mark.parametrize("schedule,p,v,m", CASES + [("interleaved-1f1b", 8, 4, 32)])
def test_a_ranks_worst_moment_holds_at_most_each_stages_most(schedule, p, v, m):
    """Counted together, a rank's stages hold what they hold at its worst moment: the most it holds
    at once, played here action by action, and no stage more than its own most."""
    n = p * v
    rank_of = lambda s: stage_rank(schedule, p, s)  # noqa: E731
    orders = _orders(schedule, p, v, m)
    proofs = delivery_proofs(orders, rank_of, n)
    together, own = unproven_sends(schedule, p, v, m), unproven_sends(schedule, p, v, m, together=False)
    for r in range(p):
        held = most = 0
        for kind, s, j in orders[r]:
            held -= len(proofs[r].get((kind, s, j), ()))
            held += kind in ("B", "I") and s > 0 and rank_of(s - 1) != r
            most = max(most, held)
        mine = [s for s in range(n) if rank_of(s) == r]
        assert sum(together[s] for s in mine) == most, r
        assert all(together[s] <= own[s] for s in mine)
