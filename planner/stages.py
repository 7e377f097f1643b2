"""What a pipeline stage costs under one mesh and schedule configuration, and an assignment's bound.

A stage holds k identical blocks (plus the embedding and/or the head); its options are a ZeRO level
and how many of its blocks are recomputed fully, selectively or not at all (only the counts
matter). Every option is priced from the cached per-layer costs of planner.cost (layer_cost), the
way planner.cost.estimate adds them up: forward f, backward b (recomputation, exposed ZeRO-3
gathers), gradient sync, optimizer, ZeRO-1/2 gather, and memory (model state by ZeRO level,
activations x micro-batches in flight, replay, buffers; under zbv's split backward also what is
held from each I to its W). Options dominated within their ZeRO level (no faster backward for no
fewer activations, same replay) are dropped. A stage mixes at most two of the three modes
(MIXED_MODES): with its block count and its memory as the two constraints, choosing how many
blocks run each mode at the least time is a linear programme whose optimum has at most two modes
non-zero (a vertex of two constraints); a third only adds steps finer than one block's change of
mode. It also keeps the menus small: (k + 1)(k + 2) / 2 combinations of k blocks become 3k. Megatron-LM
(one --recompute-granularity, --recompute-num-layers of them full) and Galvatron (each layer
checkpointed or not) mix at most two as well.

The bounds are those of planner.search's docstring: `config_bound` and `balance_bound` for a whole
configuration (planner.bounds), `evaluate` (exact memory check and LB) for one assignment.
"""
from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import numpy as np

from planner.fsdp_memory import zero_state_bytes
from planner.memory import backward_flow_bytes, first_backward_binds, first_backward_peak, stage_recv_bytes
from planner.menus import Menus
from planner.pareto import pareto, top_mode
from planner.precision import deferred_grad_bytes, fsdp_copy_bytes
from planner.model import RECOMPUTE_MODES
from planner.plan import split_backward, stage_rank
from planner.bounds import TOL, Bounds
from planner.schedule import BLOCKING_P2P  # with blocking sends a rank's own sends count in its serial work

MIXED_MODES = 2  # recompute modes a stage mixes at most (module doc)


class MenuCache(dict):
    """Stage menus shared between configurations, least recently stored dropped past MAX_BYTES
    (a deep model's menus would otherwise take gigabytes: Llama 3 405B's search peaked at 4.1 GB)."""

    MAX_BYTES = 256 * 2**20

    def __init__(self):
        super().__init__()
        self.nbytes = 0
        self._sizes: dict = {}
        self._order: deque = deque()  # keys, oldest first (next(iter(dict)) slows as the front empties)

    def __setitem__(self, key, menu):
        self.put(key, menu, sum(v.nbytes for v in menu.values() if isinstance(v, np.ndarray)))

    def put(self, key, menu, nbytes: int):
        """Store a menu whose arrays take `nbytes` (the views of one block count once)."""
        if key in self._sizes:
            self.nbytes -= self._sizes[key]
        else:
            self._order.append(key)
        self._sizes[key] = nbytes
        self.nbytes += nbytes
        super().__setitem__(key, menu)
        while self.nbytes > self.MAX_BYTES and len(self) > 1:
            oldest = self._order.popleft()
            self.nbytes -= self._sizes.pop(oldest)
            super().__delitem__(oldest)


class StageCosts(Menus, Bounds):
    """One configuration: stage option menus and bounds (planner.partition.Inner searches them)."""

    def __init__(self, ctx, cfg):
        self.ctx, self.cfg = ctx, cfg
        m = ctx.model
        self.L = m.layers
        self.S = cfg.pp * cfg.v
        z = ctx.space.zero if cfg.zero is None else (cfg.zero,)
        if cfg.dp_replicate > 1 or cfg.ep > 1:  # HSDP, expert parallelism: ZeRO 1-3 on every stage
            z = [x for x in z if x >= 1]  # (configs leaves at least one)
        self.zeros = tuple(z) if cfg.shards > 1 else (min(z),)
        self.modes = (cfg.recompute,) if cfg.recompute else tuple(ctx.space.recompute)
        self.split = split_backward(cfg.schedule, cfg.pp)  # I and W apart (zbv)
        self.lc = ctx.layers(cfg.tp, cfg.micro_batch, cfg.sp, cfg.micro_batches > 1, cfg.shards == 1, self.split, cfg.cp,
                             cfg if cfg.ep > 1 else None)
        self.rank_of = [stage_rank(cfg.schedule, cfg.pp, s) for s in range(self.S)]
        self.stages_of = [[] for _ in range(cfg.pp)]
        for s, r in enumerate(self.rank_of):
            self.stages_of[r].append(s)
        # ranks whose peak falls in their stage's first backward (planner.memory.first_backward_binds)
        self.first_b = [first_backward_binds(cfg.schedule, cfg.pp, cfg.v, cfg.micro_batches, r) for r in range(cfg.pp)]
        self.fb = any(self.first_b)  # then menus keep what that moment needs to stay exact
        t = ctx.train
        # processes sharing fewer compute units than there are of them (planner.schedule.Sharing):
        # the machine does at most max(slots, 1) process-seconds of the operations' work a second
        slots, world = ctx.cluster.compute_slots, cfg.pp * cfg.grad_ranks * cfg.tp
        self.share = max(slots, 1.0) / (cfg.tp * cfg.grad_ranks) if (slots is not None and slots < world) else None
        self.act_grad = backward_flow_bytes(m, t, cfg.tp, cfg.sp, cfg.shards, cfg.rank_micro_batch)
        self.head_logits = m.loss_bytes(cfg.rank_micro_batch, t.seq_len, cfg.tp, ctx.e)[1]

    def setup(self):
        """Collective costs of the data-parallel group and the activations in flight."""
        self.ag, self.ar, self.rs, self.dp_shape = self.ctx.collectives(self.cfg)
        self.rep_ar, self.rep_shape = self.ctx.replicas(self.cfg)
        self.experts = self.ctx.experts(self.cfg)  # expert parallelism's shard group (Ctx.experts), or None
        self.flight, self.maxcnt, _ = self.ctx.in_flight(self.cfg)
        cfg = self.cfg
        msg = self._message()
        mesh = SimpleNamespace(order=list(cfg.order), pp=cfg.pp, dp=cfg.dp, tp=cfg.tp, cp=cfg.cp)
        transfer = self._transfer(msg)
        p2p = [transfer(_rank(mesh, r, 0, 0), _rank(mesh, (r + 1) % cfg.pp, 0, 0)) for r in range(cfg.pp)]
        back = [transfer(_rank(mesh, r, 0, 0), _rank(mesh, (r - 1) % cfg.pp, 0, 0)) for r in range(cfg.pp)]
        # the forward chain to stage r waits for each send s -> s+1, the backward chain for s+1 -> s
        self.lag = [p2p[s] + back[(s + 1) % cfg.pp] for s in range(cfg.pp)]
        self.fwd_lag = p2p
        # a rank that waits for its own sends (blocking point-to-point) also spends them serially;
        # none between two stages of one rank (zbv's middle)
        S, ro = self.S, self.rank_of
        known = {(r, (r + 1) % cfg.pp): p2p[r] for r in range(cfg.pp)}
        known.update({(r, (r - 1) % cfg.pp): back[r] for r in range(cfg.pp)})

        def hop(a, b):
            if a == b:
                return 0.0
            if (a, b) not in known:
                known[(a, b)] = transfer(_rank(mesh, a, 0, 0), _rank(mesh, b, 0, 0))
            return known[(a, b)]
        self.sends = [(hop(ro[s], ro[s + 1]) if s < S - 1 else 0.0) + (hop(ro[s], ro[s - 1]) if s > 0 else 0.0)
                      if BLOCKING_P2P else 0.0 for s in range(S)]
        # the chain's way back from rank r > 0 (lag[r - 1]) starts with r's last send to r - 1, which
        # its serial work already counts when sends block: once in the bound (evaluate)
        self.own_back = [back[r] if (BLOCKING_P2P and r > 0) else 0.0 for r in range(cfg.pp)]
        return self

    def _transfer(self, msg):
        """Seconds of a stage's transfer to another (planner.cost's): whole, or under the pipeline's
        scatter-gather p2p (without sequence parallelism) 1/tp from each TP rank and an all-gather
        over the receiving TP group (TP groups sit inside a node: every one of the same shape)."""
        cluster, tp = self.ctx.cluster, self.cfg.tp
        if not (self.ctx.scatter_p2p and tp > 1 and not self.cfg.sp):
            return lambda src, dst: cluster.p2p_time(msg, src, dst)
        gather = cluster.collective_time("all_gather", msg, range(tp))
        return lambda src, dst: cluster.p2p_time(msg / tp, src, dst) + gather

    def _message(self):
        """Bytes of one micro-batch's activation between stages."""
        cfg, m, t = self.cfg, self.ctx.model, self.ctx.train
        return self.ctx.e * cfg.rank_micro_batch * t.seq_len * m.hidden / (cfg.tp if cfg.sp else 1)

    def _recv(self):
        """Per stage the pipeline's receive buffers (planner.memory.stage_recv_bytes, as the plans the
        search builds have them: the runtime's or a framework's, search()): fixed by the
        configuration, whatever the partition."""
        S, msg = self.S, self._message()
        cfg = self.cfg
        key = (cfg.schedule, cfg.pp, S, cfg.micro_batches, msg)
        if key not in self.ctx._recv:  # the search's cache
            self.ctx._recv[key] = [stage_recv_bytes(self.ctx.recv_buffers, self.ctx.sent_kept, cfg.schedule, cfg.pp,
                                                    s, S - 1, cfg.micro_batches, msg) for s in range(S)]
        return self.ctx._recv[key]

    def _recv_by_rank(self):
        recv = self._recv()
        return np.array([sum(recv[s] for s in self.stages_of[r]) for r in range(self.cfg.pp)])

    # -------------------------------------------------------------- menus
    def combos(self, k):
        """(n_none, n_selective, n_full) block counts a stage of k blocks may use, as an array. Under
        a split backward (zbv) one mode a stage: a full block's replay is then held from I to W, so
        a block's activations plus what it holds then are the same recomputed or not, no count of
        full blocks dominates another, and per-layer counts would make k^2 / 2 options a stage
        where one mode a stage makes 3."""
        g = self.ctx.space.recompute_granularity if not self.cfg.recompute else "plan"
        if g == "layer" and self.split:
            g = "stage"
        key = (k, self.modes, g)
        if key not in self.ctx._combos:
            idx = [RECOMPUTE_MODES.index(x) for x in self.modes]
            if k == 0:
                out = [(0, 0, 0)]
            elif g in ("plan", "stage"):
                out = [tuple(k if j == i else 0 for j in range(3)) for i in idx]
            else:  # (a, b, k - a - b) for a in 0..k, b in 0..k - a, only the allowed modes non-zero,
                # and at most two of them (MIXED_MODES)
                runs = np.arange(k + 1, 0, -1)
                a = np.repeat(np.arange(k + 1), runs)
                b = np.arange(len(a)) - np.repeat(np.cumsum(runs) - runs, runs)
                out = np.stack([a, b, k - a - b], axis=1)
                out = out[(out[:, [j for j in range(3) if j not in idx]] == 0).all(axis=1)
                          & ((out > 0).sum(axis=1) <= MIXED_MODES)]
            self.ctx._combos[key] = np.array(out, dtype=float)
        return self.ctx._combos[key]

    def blocks(self, k):
        """Block part of a stage of k blocks per recompute combination: (combos, backward compute,
        backward TP time, activations, replay bytes, the combinations not dominated without ZeRO-3,
        forward compute, forward TP time, weight-gradient time). Under a split backward (zbv) a full
        block's replay is held from I to W (menu's held_iw), not a transient, and combinations are
        compared with those of as many full blocks. A block's forward (and its backward's weight
        share) is the same in every mode as the cost model prices it; a model profile measures each
        mode's, and then a combination is dominated only by one no slower there too."""
        cfg = self.cfg
        split = self.split
        if "_blocks_key" not in self.__dict__:
            self._blocks_key = (cfg.tp, cfg.micro_batch, cfg.cp, cfg.sp, cfg.micro_batches > 1, cfg.shards == 1, self.modes,
                                id(self.lc),  # its layers' costs (cached by the search: Ctx.layers)
                                self.ctx.space.recompute_granularity if not cfg.recompute else "plan", self.fb)
        key = (*self._blocks_key, k, split)
        if key not in self.ctx._blocks:
            cb = self.combos(k)
            blk = [self.lc["blk"][r] for r in RECOMPUTE_MODES]
            col = lambda a: np.array([getattr(x, a) for x in blk])
            comp_b, tp_b, act = cb @ col("bwd_compute_s"), cb @ col("bwd_tp_s"), cb @ col("activation_bytes")
            if split:
                replay = np.where(cb[:, 1] > 0, blk[1].replay_bytes, 0.0)
                classes = cb[:, 2] + (k + 1) * (cb[:, 1] > 0)
            else:
                replay = classes = np.max(np.where(cb > 0, col("replay_bytes")[None, :], 0.0), axis=1)
                if self.fb:  # a stage's first backward also depends on its largest mode (menus' "top")
                    classes = np.unique(replay, return_inverse=True)[1] * 3 + top_mode(cb, col("activation_bytes"))
            comp_f, tp_f, comp_w = cb @ col("fwd_compute_s"), cb @ col("fwd_tp_s"), cb @ col("bwd_weight_s")
            keep = pareto(comp_b + tp_b, act, classes, self._by_mode(comp_f + tp_f, comp_w))
            self.ctx._blocks[key] = (cb, comp_b, tp_b, act, replay, keep, comp_f, tp_f, comp_w)
        return self.ctx._blocks[key]

    def _by_mode(self, fwd, wgrad):
        """Of an option's forward and (under a split backward) weight-gradient times, those that a
        block's recompute mode changes (a model profile's measurements): what options must also be
        no worse in to dominate another (planner.pareto.pareto)."""
        blk = [self.lc["blk"][r] for r in RECOMPUTE_MODES]
        differ = lambda a: len({a(x) for x in blk}) > 1  # noqa: E731
        return ([fwd] if differ(lambda x: x.fwd_compute_s + x.fwd_tp_s) else []) + \
            ([wgrad] if self.split and differ(lambda x: x.bwd_weight_s) else [])

    def _state(self, z, experts=False):
        """(parameter, gradient, optimizer-state) bytes per parameter at ZeRO level z; `experts`: of
        the experts expert parallelism spreads, which FSDP2 shards over shards / ep ranks (planner.memory)."""
        ctx, cfg = self.ctx, self.cfg
        if experts:
            return zero_state_bytes(z, cfg.shards // cfg.ep, cfg.micro_batches, ctx.pb, ctx.gb, ctx.ob, ctx.spb,
                                    fsdp=True, defer=ctx.train.defer_grad_sync,
                                    deferred_gb=deferred_grad_bytes(ctx.train))
        states = (ctx.pb, ctx.gb, ctx.ob) if cfg.shards > 1 else ctx.states_dp1
        return zero_state_bytes(z, cfg.shards, cfg.micro_batches, *states, ctx.spb, defer=ctx.train.defer_grad_sync,
                                deferred_gb=deferred_grad_bytes(ctx.train))

    def _per_param(self, z):
        """Per parameter at ZeRO level z: the bytes the ZeRO paper counts (_state) and the seconds of
        FSDP2's buffer copies (forward, backward, step; planner.precision.fsdp_copy_bytes)."""
        memo = self.__dict__.setdefault("_per_param_memo", {})
        if z not in memo:
            ctx, cfg = self.ctx, self.cfg
            copies = ((x / ctx.bw for x in fsdp_copy_bytes(z, cfg.shards, cfg.micro_batches, ctx.e, ctx.gb,
                                                           ctx.train.defer_grad_sync))
                      if ctx.train.fsdp_copies else (0.0, 0.0, 0.0))
            memo[z] = sum(self._state(z)), tuple(copies)
        return memo[z]

    def flags(self, s):
        return s == 0, s == self.S - 1

    # columns of an option's row (Menus._build_menus' "rows"; what evaluate reads)
    F, FB, TAIL, SYNC, FIXED, ACT, HELD_IW, REPLAY, END, FSDP, LOGITS, GRADS, FIRST, DLAST = range(14)

    def _evaluate_setup(self):
        """What evaluate reads of the configuration, as arrays over pipeline ranks."""
        cfg, p = self.cfg, self.cfg.pp
        width = max(f.shape[1] for f in self.flight)
        flight = np.zeros((p, max(len(f) for f in self.flight), width))
        for r, f in enumerate(self.flight):  # padded with moments holding nothing
            flight[r, :len(f)] = f
        zbv = cfg.schedule == "zbv"
        self._ev = SimpleNamespace(
            sidx=np.array(self.stages_of), flight=flight, recv=self._recv_by_rank(),
            first_b=np.array(self.first_b, dtype=bool), sends=np.array(self.sends)[np.array(self.stages_of)],
            own_back=np.array(self.own_back), lag=np.array(self.fwd_lag if zbv else self.lag), zbv=zbv)
        return self._ev

    def evaluate(self, assign):
        """Exact LB and memory check of an assignment [(k, menu, option index) per stage]: its LB,
        or None where it does not fit."""
        return self.evaluate_many([assign])[0]

    def evaluate_many(self, assigns) -> list:
        """evaluate of each assignment, together (numpy's cost per call paid once)."""
        if not assigns:
            return []
        ev = self.__dict__.get("_ev") or self._evaluate_setup()
        p, mbs = self.cfg.pp, self.cfg.micro_batches
        rows = np.array([[mn["rows"][i] for _, mn, i in a] for a in assigns])  # (assignments, stages, 14)
        a = rows[:, ev.sidx]  # (assignments, ranks, chunks, 14): each rank's stages
        # memory first: an assignment that does not fit is not timed
        fixed = a[..., self.FIXED].sum(axis=-1) + ev.recv
        acts = a[..., self.ACT]
        if self.cfg.v > 1:  # what each chunk holds from I to W, and its gradients once they exist
            acts = np.concatenate((acts, a[..., self.HELD_IW], a[..., self.GRADS]), axis=-1)
            fixed -= a[..., self.GRADS].sum(axis=-1)
        peak = (ev.flight[None] @ acts[..., None])[..., 0].max(axis=-1)  # the worst moment's
        if self.fb:  # one stage: its gradients grow as its first backward frees activations
            one = a[:, :, 0]
            fixed = np.where(ev.first_b, fixed - one[..., self.GRADS], fixed)
            peak = np.where(ev.first_b, first_backward_peak(peak, one[..., self.ACT], one[..., self.GRADS],
                                                             one[..., self.FIRST]), peak)
        rep = a[..., self.REPLAY].max(axis=-1) + self.act_grad  # one stage computes at a time
        logits = a[..., self.LOGITS].max(axis=-1)  # the loss's forward, on the head's rank
        rep = np.where(logits > 0, np.maximum(rep, logits + a[..., self.FSDP].max(axis=-1)), rep)
        end = a[..., self.END].sum(axis=-1) + ev.recv  # a tied pair's end of the backward
        fits = (np.maximum(fixed + peak + rep, end) <= self.ctx.lim_eff * (1 + TOL)).all(axis=-1)
        work = mbs * (a[..., self.FB] + ev.sends).sum(axis=-1)  # m W_r
        # its first stage's sync, and every tail: each rank's tail (its optimizer step) waits for
        # every rank's end (planner.cost: the gradient norm over the pipeline ranks), so the step
        # ends with the longest
        once = a[:, :, 0, self.SYNC] + a[..., self.TAIL].sum(axis=-1).max(axis=-1, keepdims=True)
        # a stage's last backward at its own bound where that is below FB's (DLAST <= 0): its first
        # chunk's in SYNC, the other chunks' here
        work = work + a[:, :, 1:, self.DLAST].sum(axis=-1)
        # the chain to rank r: the earlier stages' forwards, and (1F1B, interleaved) their backwards
        # after r's last (the last backwards, rank 0's in its SYNC); under zbv their weight
        # gradients need not wait: forwards only
        hop = rows[:, :p, self.F if ev.zbv else self.FB] + ev.lag
        if not ev.zbv:
            hop[:, 1:] += rows[:, 1:p, self.DLAST]
        pre = np.concatenate((np.zeros((len(rows), 1)), np.cumsum(hop[:, :-1], axis=1)), axis=1)
        lb = (work + once).max(axis=-1)
        if ev.zbv:
            lb = np.maximum(lb, (pre + work + once).max(axis=-1))
        else:  # ends on rank 0; rank r > 0's last backward at its own bound
            own = np.concatenate((np.zeros((len(rows), 1)), a[:, 1:, 0, self.DLAST]), axis=1)
            lb = np.maximum(lb, (pre + work + own - ev.own_back).max(axis=-1) + once[:, 0])
        if self.share:  # every F and B of every stage, done by its tp x dp processes, at most that fast
            lb = np.maximum(lb, mbs * rows[..., self.FB].sum(axis=-1) / self.share)
        if self.cfg.v > 1 and not ev.zbv:  # micro-batch 0's forward through every stage and backward back
            lb = np.maximum(lb, rows[..., self.FB].sum(axis=-1))
        return [float(x) if ok else None for x, ok in zip(lb, fits)]


def _rank(mesh, pp, dp, tp):
    r, co = 0, {"pp": pp, "dp": dp, "tp": tp, "cp": 0}
    for d in mesh.order:
        r = r * getattr(mesh, d) + co[d]
    return r


def distinct_orders(cluster, tp: int, pp: int, dp: int, orders, cp: int = 1) -> list:
    """The rank orders (mesh.order) among `orders` that place the mesh differently: an order that
    puts every (pp, dp, cp, tp) coordinate on the same node as an earlier one does is the same plan
    to the cost model, which prices groups by the nodes their ranks are on (ClusterSpec.group_shape),
    so it is left out (on one node every order is the first)."""
    seen, out = set(), []
    sizes = {"pp": pp, "dp": dp, "cp": cp, "tp": tp}
    coords = dict(zip(sizes, np.indices(tuple(sizes.values()))))
    for order in orders:
        ranks = 0
        for d in order:  # _rank over every (pp, dp, cp, tp) coordinate at once
            ranks = ranks * sizes[d] + coords[d]
        nodes = cluster.nodes_of(ranks.ravel()).tobytes()  # ranks: (pp, dp, cp, tp), every dim in order
        if nodes not in seen:
            seen.add(nodes)
            out.append(order)
    return out
