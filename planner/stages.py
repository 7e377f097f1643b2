"""What a pipeline stage costs under one mesh and schedule configuration, and lower bounds.

A stage holds k identical blocks (plus the embedding and/or the head); its options are a ZeRO level
and how many of its blocks are recomputed fully, selectively or not at all (only the counts
matter). Every option is priced from the cached per-layer costs of planner.cost (layer_cost), the
way planner.cost.estimate adds them up: forward f, backward b (recomputation, exposed ZeRO-3
gathers), gradient sync, optimizer, ZeRO-1/2 gather, and memory (model state by ZeRO level,
activations x micro-batches in flight, replay, buffers). Options dominated within their ZeRO level
(no faster backward for no fewer activations, same replay) are dropped.

The bounds are those of planner.search's docstring: `config_bound` and `balance_bound` for a whole
configuration, `evaluate` (exact memory check and LB) for one assignment.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np

from planner.cost import tied_head
from planner.memory import accumulation_bytes, fsdp_extra_parts, step_bytes, tied_matrix_grad_bytes, zero_state_bytes
from planner.precision import fsdp_copy_bytes
from planner.model import RECOMPUTE_MODES
from planner.plan import stage_rank
from planner.schedule import BLOCKING_P2P  # with blocking sends a rank's own sends count in its serial work
TOL = 1e-9


class MenuCache(dict):
    """Stage menus shared between configurations, least recently stored dropped past MAX_BYTES
    (a deep model's menus would otherwise take gigabytes: Llama 3 405B's search peaked at 4.1 GB)."""

    MAX_BYTES = 256 * 2**20

    def __init__(self):
        super().__init__()
        self.nbytes = 0
        self._sizes: dict = {}

    def __setitem__(self, key, menu):
        self.put(key, menu, sum(v.nbytes for v in menu.values() if isinstance(v, np.ndarray)))

    def put(self, key, menu, nbytes: int):
        """Store a menu whose arrays take `nbytes` (the views of one block count once)."""
        self._sizes[key] = nbytes
        self.nbytes += nbytes
        super().__setitem__(key, menu)
        while self.nbytes > self.MAX_BYTES and len(self) > 1:
            oldest = next(iter(self))  # dicts keep insertion order
            self.nbytes -= self._sizes.pop(oldest)
            super().__delitem__(oldest)


class StageCosts:
    """One configuration: stage option menus and bounds (planner.partition.Inner searches them)."""

    def __init__(self, ctx, cfg):
        self.ctx, self.cfg = ctx, cfg
        m = ctx.model
        self.L = m.layers
        self.S = cfg.pp * cfg.v
        self.lc = ctx.layers(cfg.tp, cfg.micro_batch, cfg.sp, cfg.micro_batches > 1)
        z = ctx.space.zero if cfg.zero is None else (cfg.zero,)
        self.zeros = tuple(z) if cfg.dp > 1 else (min(z),)
        self.modes = (cfg.recompute,) if cfg.recompute else tuple(ctx.space.recompute)
        if cfg.schedule == "zbv":  # the runtime runs ZB-V without recomputation
            self.modes = ("none",)
        self.rank_of = [stage_rank(cfg.schedule, cfg.pp, s) for s in range(self.S)]
        self.stages_of = [[] for _ in range(cfg.pp)]
        for s, r in enumerate(self.rank_of):
            self.stages_of[r].append(s)
        t = ctx.train
        # processes sharing fewer compute units than there are of them (planner.schedule.Sharing):
        # the machine does at most max(slots, 1) process-seconds of the operations' work a second
        slots, world = ctx.cluster.compute_slots, cfg.pp * cfg.dp * cfg.tp
        self.share = max(slots, 1.0) / (cfg.tp * cfg.dp) if (slots is not None and slots < world) else None
        self.act_grad = 2 * ctx.e * cfg.micro_batch * t.seq_len * m.hidden
        self.head_logits = m.loss_bytes(cfg.micro_batch, t.seq_len, cfg.tp, ctx.e)[1]

    def setup(self):
        """Collective costs of the data-parallel group and the activations in flight."""
        self.ag, self.ar, self.rs, self.dp_shape = self.ctx.collectives(self.cfg)
        self.flight, self.maxcnt, _ = self.ctx.in_flight(self.cfg)
        cfg, m, t = self.cfg, self.ctx.model, self.ctx.train
        msg = self.ctx.e * cfg.micro_batch * t.seq_len * m.hidden / (cfg.tp if cfg.sp else 1)
        mesh = SimpleNamespace(order=list(cfg.order), pp=cfg.pp, dp=cfg.dp, tp=cfg.tp)
        p2p = [self.ctx.cluster.p2p_time(msg, _rank(mesh, r, 0, 0), _rank(mesh, (r + 1) % cfg.pp, 0, 0))
               for r in range(cfg.pp)]
        back = [self.ctx.cluster.p2p_time(msg, _rank(mesh, r, 0, 0), _rank(mesh, (r - 1) % cfg.pp, 0, 0))
                for r in range(cfg.pp)]
        # the forward chain to stage r waits for each send s -> s+1, the backward chain for s+1 -> s
        self.lag = [p2p[s] + back[(s + 1) % cfg.pp] for s in range(cfg.pp)]
        self.fwd_lag = p2p
        # a rank that waits for its own sends (blocking point-to-point) also spends them serially;
        # none between two stages of one rank (zbv's middle)
        S, ro = self.S, self.rank_of

        def hop(a, b):
            return 0.0 if a == b else self.ctx.cluster.p2p_time(msg, _rank(mesh, a, 0, 0), _rank(mesh, b, 0, 0))
        self.sends = [(hop(ro[s], ro[s + 1]) if s < S - 1 else 0.0) + (hop(ro[s], ro[s - 1]) if s > 0 else 0.0)
                      if BLOCKING_P2P else 0.0 for s in range(S)]
        # the runtime's receive buffers, one per micro-batch, held all step (planner.memory.recv_buffer_bytes)
        self.recv = [((s > 0) + (s < S - 1)) * cfg.micro_batches * msg if S > 1 else 0.0 for s in range(S)]
        return self

    # -------------------------------------------------------------- menus
    def combos(self, k):
        """(n_none, n_selective, n_full) block counts a stage of k blocks may use, as an array."""
        g = self.ctx.space.recompute_granularity if not self.cfg.recompute else "plan"
        key = (k, self.modes, g)
        if key not in self.ctx._combos:
            idx = [RECOMPUTE_MODES.index(x) for x in self.modes]
            if k == 0:
                out = [(0, 0, 0)]
            elif g in ("plan", "stage"):
                out = [tuple(k if j == i else 0 for j in range(3)) for i in idx]
            else:
                out = [(a, bb, k - a - bb) for a in range(k + 1) for bb in range(k + 1 - a)
                       if all(n == 0 or j in idx for j, n in enumerate((a, bb, k - a - bb)))]
            self.ctx._combos[key] = np.array(out, dtype=float)
        return self.ctx._combos[key]

    def blocks(self, k):
        """Block part of a stage of k blocks per recompute combination: (combos, backward compute,
        backward TP time, activations, replay bytes, the combinations not dominated without ZeRO-3)."""
        cfg = self.cfg
        key = (cfg.tp, cfg.micro_batch, cfg.sp, cfg.micro_batches > 1, self.modes,
               self.ctx.space.recompute_granularity if not cfg.recompute else "plan", k)
        if key not in self.ctx._blocks:
            cb = self.combos(k)
            blk = [self.lc["blk"][r] for r in RECOMPUTE_MODES]
            col = lambda a: np.array([getattr(x, a) for x in blk])
            comp_b, tp_b, act = cb @ col("bwd_compute_s"), cb @ col("bwd_tp_s"), cb @ col("activation_bytes")
            replay = np.max(np.where(cb > 0, col("replay_bytes")[None, :], 0.0), axis=1)
            self.ctx._blocks[key] = (cb, comp_b, tp_b, act, replay, _pareto(comp_b + tp_b, act, replay))
        return self.ctx._blocks[key]

    def menu(self, k, emb, head):
        """Options of a stage with k blocks (+ embedding / head): arrays over (zero, combo), without
        dominated ones (same ZeRO level and replay, no faster backward for no fewer activations)."""
        local = self.__dict__.setdefault("_local_menus", {})
        if (k, emb, head) in local:
            return local[(k, emb, head)]
        cfg = self.cfg
        split = cfg.schedule == "zbv" and cfg.pp > 1  # a split backward prices ZeRO 2/3 apart (one combo)
        # what a menu depends on: the data-parallel group by its shape, not by the mesh order that made it
        key = (cfg.tp, cfg.micro_batch, cfg.sp, cfg.micro_batches > 1, cfg.micro_batches == 1, self.dp_shape,
               self.zeros, self.modes, self.ctx.space.recompute_granularity, k, emb, head, split)
        if key in self.ctx._menus:
            local[(k, emb, head)] = self.ctx._menus[key]
            return local[(k, emb, head)]
        ctx, lc = self.ctx, self.lc
        ends = ([lc["emb"]] if emb else []) + ([lc["head"]] if head else [])
        if emb and head and ctx.model.tie_embeddings:
            ends[-1] = tied_head(ctx.model, ends[-1], cfg.tp)
        cb, comp_b, tp_b, act, replay, plain = self.blocks(k)
        blk = [lc["blk"][r] for r in RECOMPUTE_MODES]
        e_sum = lambda a: sum(getattr(x, a) for x in ends)
        comp_f = k * blk[0].fwd_compute_s + e_sum("fwd_compute_s")
        comp_b = comp_b + e_sum("bwd_compute_s")
        tp_f = k * blk[0].fwd_tp_s + e_sum("fwd_tp_s")
        tp_b = tp_b + e_sum("bwd_tp_s")
        act = act + e_sum("activation_bytes")
        P = k * blk[0].params + sum(x.params for x in ends)
        dp, e = cfg.dp, ctx.e
        layers = [1] * (k > 0) + [0] * emb + [ctx.model.layers + 1] * head  # one of each kind the stage holds
        accum = accumulation_bytes(ctx.model, layers, cfg.tp, dp, cfg.micro_batches, ctx.gb)
        n_all = sum(len(plain) if not (z == 3 and dp > 1) else len(cb) for z in self.zeros)
        arr = np.empty((12, n_all))
        at = 0
        comp_w = k * blk[0].bwd_weight_s + e_sum("bwd_weight_s")
        coll = (self.dp_shape, P)  # the same for every micro-batch size and sequence-parallel setting
        if coll not in ctx._coll_times:
            ctx._coll_times[coll] = ((self.ag(P * e), self.ar(P * ctx.gb), self.rs(P * ctx.gb)) if dp > 1
                                     else (0.0, 0.0, 0.0))
        gathered, all_reduced, scattered = ctx._coll_times[coll]
        cb_min, blocks, root = comp_b.min(), [blk[0].params] * k, sum(x.params for x in ends)
        tied = emb and head and ctx.model.tie_embeddings
        if tied:  # the end of the backward can hold more
            tied_bytes, tied_end = tied_matrix_grad_bytes(ctx.model, cfg.tp, ctx.gb, cfg.micro_batches)
        for z in self.zeros:
            state, copies, step_per_param = self._per_param(z)
            ag = gathered if z == 3 else 0.0
            sync = all_reduced if z == 0 else scattered
            # ZeRO-2/3 reduce-scatter each micro-batch's gradients beside its backward
            beside = ag + sync if (z >= 2 and dp > 1 and cfg.micro_batches > 1) else ag
            # FSDP2's buffer copies on the compute stream (planner.precision.fsdp_copy_bytes)
            copy_f, copy_b, copy_s = (x * P for x in copies)
            f = comp_f + tp_f + max(0.0, ag - comp_f) + copy_f
            b = comp_b + tp_b + np.maximum(0.0, beside - comp_b) + copy_b
            if split and z >= 2 and dp > 1:  # planner.cost: I and W gather, W then reduce-scatters
                b = comp_b + tp_b + 2 * ag + max(0.0, sync - comp_w) + copy_b
            keep = _pareto(b, act, replay) if beside > cb_min else plain  # exposure reorders
            opt = P / (dp if z >= 1 else 1) * ctx.osb / ctx.bw
            gather = (gathered if z in (1, 2) else 0.0) + copy_s
            extra = (z, dp, cfg.micro_batches > 1, split, blk[0].params, k, root)  # all FSDP2's buffers depend on
            if extra not in ctx._fsdp_extra:
                ctx._fsdp_extra[extra] = fsdp_extra_parts(z, dp, cfg.micro_batches, blocks, root, ctx.pb, ctx.gb,
                                                          ctx.spb, split, ctx.cluster.backend == "gloo")
            held, transient = ctx._fsdp_extra[extra]
            transient += accum
            fixed = P * state + held
            if z == 0 and dp > 1:  # replicate's gradients in the compute dtype beside the reduced ones
                fixed += P * ctx.pb
            step = P * step_per_param  # the optimizer step's moment
            if tied:
                step = max(step, fixed + self.act_grad + tied_end)
                fixed += tied_bytes
            fixed += self.head_logits if head else 0.0
            sl = slice(at, at + len(keep))
            at += len(keep)
            arr[_SCALAR_ROWS, sl] = np.array((f, sync, opt, gather, fixed, z, transient, step))[:, None]
            arr[_ARRAY_ROWS, sl] = (b[keep], act[keep], replay[keep], keep)
        arr = arr[:, :at].copy()  # a slice would keep the whole preallocated block alive in the cache
        menu = dict(zip(("f", "b", "sync", "opt", "gather", "fixed", "act", "replay", "zero", "combo", "transient",
                         "step"), arr))
        menu["combo"] = menu["combo"].astype(int)
        menu["cb"] = cb
        menu["c"] = cfg.micro_batches * (menu["f"] + menu["b"]) + menu["sync"] + menu["opt"] + menu["gather"]
        self.ctx._menus.put(key, menu, arr.nbytes + cb.nbytes + menu["combo"].nbytes + menu["c"].nbytes)
        local[(k, emb, head)] = menu
        return menu

    def _state(self, z):
        """(parameter, gradient, optimizer-state) bytes per parameter at ZeRO level z."""
        ctx, cfg = self.ctx, self.cfg
        return zero_state_bytes(z, cfg.dp, cfg.micro_batches, ctx.pb, ctx.gb, ctx.ob, ctx.spb)

    def _per_param(self, z):
        """Per parameter at ZeRO level z: the bytes the ZeRO paper counts (_state), the seconds of
        FSDP2's buffer copies (forward, backward, step; planner.precision.fsdp_copy_bytes) and the
        bytes held in the optimizer step (planner.memory.step_bytes, linear in the parameters)."""
        memo = self.__dict__.setdefault("_per_param_memo", {})
        if z not in memo:
            ctx, cfg = self.ctx, self.cfg
            copies = ((x / ctx.bw for x in fsdp_copy_bytes(z, cfg.dp, cfg.micro_batches, ctx.e, ctx.gb))
                      if ctx.train.fsdp_copies else (0.0, 0.0, 0.0))
            memo[z] = sum(self._state(z)), tuple(copies), sum(step_bytes(ctx.train, z, cfg.dp, 1.0))
        return memo[z]

    def flags(self, s):
        return s == 0, s == self.S - 1

    # -------------------------------------------------------------- bounds
    def config_bound(self):
        """(lower bound on step time, lower bound on per-device memory) for any inner choice."""
        ctx, cfg, lc = self.ctx, self.cfg, self.lc
        w = lambda x: x.fwd_compute_s + x.bwd_compute_s + x.fwd_tp_s + x.bwd_tp_s
        wtot = w(lc["emb"]) + w(lc["head"]) + self.L * min(w(lc["blk"][r]) for r in self.modes)
        head = tied_head(ctx.model, lc["head"], cfg.tp) if ctx.model.tie_embeddings else lc["head"]  # at least
        P = lc["emb"].params + head.params + self.L * lc["blk"]["none"].params
        dp, mbs, p = cfg.dp, cfg.micro_batches, cfg.pp
        # LB2 averaged over ranks: every stage pays sync + optimizer + ZeRO-1/2 gather, affine in its
        # parameters (alpha + beta P), and for v = 1 each rank has one stage.
        ag, ar, rs, _ = ctx.collectives(cfg)
        segmented = not all(x.affine for op in ctx.cluster.collectives.values() for x in op.values())
        ab = lambda f: (0.0, 0.0) if segmented else (f(1.0) - (f(2.0) - f(1.0)), f(2.0) - f(1.0))
        alphas, betas = [], []
        for z in self.zeros:
            a_s, b_s = ab(ar if z == 0 else rs) if dp > 1 else (0.0, 0.0)
            a_g, b_g = ab(ag) if (dp > 1 and z in (1, 2)) else (0.0, 0.0)
            alphas.append((a_s + a_g) if cfg.v == 1 else 0.0)
            betas.append((b_s * ctx.gb if cfg.v == 1 else 0.0) + b_g * ctx.e
                         + ctx.osb / ctx.bw / (dp if z >= 1 else 1))
        lb = (mbs * wtot + p * min(alphas) + P * min(betas)) / p
        if cfg.v == 1 and p > 1:
            lb = max(lb, wtot / (1.0 - (1.0 - 1.0 / mbs) ** p))
        if self.share:  # the whole model's work on shared compute (evaluate)
            lb = max(lb, mbs * wtot / self.share)
        state = min(sum(self._state(z)) for z in self.zeros)
        return lb, P * state / p + self.act_grad

    def balance_bound(self, bound=math.inf):
        """A lower bound on m x (the busiest rank's work per micro-batch) that respects memory, or inf
        when no partition can fit. Relaxation: blocks may be split fractionally over ranks and
        take any recompute mode; rank r holds at least kappa_r micro-batches of its activations and
        at least the cheapest ZeRO state of its parameters. For a per-rank work budget U, rank r can
        take at most max n0 + n1 + n2 s.t. sum n_i t_i <= U, sum n_i (s + kappa_r a_i) <= M (an LP
        whose optimum uses at most two modes); bisect on the smallest U that places all L blocks."""
        ctx, cfg, lc = self.ctx, self.cfg, self.lc
        _, _, kappa = ctx.in_flight(cfg)
        blk = [lc["blk"][r] for r in self.modes]
        t = np.array([x.fwd_compute_s + x.bwd_compute_s + x.fwd_tp_s + x.bwd_tp_s for x in blk])
        a = np.array([x.activation_bytes for x in blk])
        mbs = cfg.micro_batches
        state = min(sum(self._state(z)) for z in self.zeros) * blk[0].params
        M = ctx.lim_eff * (1 + TOL) - self.act_grad
        mem = state + kappa[:, None] * a[None, :]  # (ranks, modes)
        pairs = [(i, j) for i in range(len(t)) for j in range(i + 1, len(t))]

        def cap(U):
            best = np.max(np.minimum(U / t[None, :], M / mem), axis=1)
            for i, j in pairs:  # both constraints tight: solve for n_i, n_j
                det = t[i] * mem[:, j] - t[j] * mem[:, i]
                with np.errstate(divide="ignore", invalid="ignore"):
                    ni = (U * mem[:, j] - t[j] * M) / det
                    nj = (t[i] * M - U * mem[:, i]) / det
                ok = (det != 0) & (ni >= 0) & (nj >= 0)
                best = np.where(ok, np.maximum(best, ni + nj), best)
            return np.maximum(best, 0.0).sum()

        if M <= 0 or cap(t.max() * self.L * 2) < self.L * (1 - 1e-9):
            return math.inf
        if math.isfinite(bound) and cap(bound / mbs) < self.L * (1 - 1e-9):
            return bound  # cannot beat the incumbent: that is all the caller needs to know
        lo, hi = 0.0, t.max() * self.L
        for _ in range(12):
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if cap(mid) >= self.L * (1 - 1e-9) else (mid, hi)
        return mbs * lo

    def evaluate(self, assign):
        """Exact LB and memory check of an assignment [(k, menu, option index) per stage]."""
        p, mbs = self.cfg.pp, self.cfg.micro_batches
        zbv = self.cfg.schedule == "zbv"
        W = [0.0] * p
        tail = [0.0] * p
        pre, pref = [], 0.0
        for s, (k, mn, i) in enumerate(assign):
            r = self.rank_of[s]
            fb = mn["f"][i] + mn["b"][i]
            W[r] += fb + self.sends[s]
            tail[r] += mn["opt"][i] + mn["gather"][i]
            if s < p:
                pre.append(pref)
                # the chain to rank r: the earlier stages' forwards, and (1F1B, interleaved) their
                # backwards after r's last; under zbv their weight gradients need not wait: forwards only
                pref += mn["f"][i] + self.fwd_lag[s] if zbv else fb + self.lag[s]
        first = [self.stages_of[r][0] for r in range(p)]
        sync = [assign[s][1]["sync"][assign[s][2]] for s in first]
        lb2 = max(mbs * W[r] + sync[r] + tail[r] for r in range(p))
        if zbv:
            lb1 = max(pre[r] + mbs * W[r] + sync[r] + tail[r] for r in range(p))
        else:
            lb1 = max(pre[r] + mbs * W[r] for r in range(p)) + sync[0] + tail[0]
        if self.share:  # every F and B of every stage, done by its tp x dp processes, at most that fast
            lb1 = max(lb1, mbs * sum(mn["f"][i] + mn["b"][i] for _, mn, i in assign) / self.share)
        for r in range(p):
            mine = [assign[s] for s in self.stages_of[r]]
            recv = sum(self.recv[s] for s in self.stages_of[r])
            fixed = sum(mn["fixed"][i] for _, mn, i in mine) + recv
            acts = np.array([mn["act"][i] for _, mn, i in mine])
            peak = float((self.flight[r] @ acts).max())
            rep = max(mn["replay"][i] + mn["transient"][i] for _, mn, i in mine)  # one stage computes at a time
            step = sum(mn["step"][i] for _, mn, i in mine) + recv
            if max(fixed + peak + rep + self.act_grad, step) > self.ctx.lim_eff * (1 + TOL):
                return None
        return max(lb1, lb2)


# the rows of a menu's array (StageCosts.menu): one value per ZeRO level, or one per option
_SCALAR_ROWS = np.array([0, 2, 3, 4, 5, 8, 10, 11])  # f, sync, opt, gather, fixed, zero, transient, step
_ARRAY_ROWS = np.array([1, 6, 7, 9])  # b, act, replay, combo


def _pareto(b, act, replay):
    """Indices not dominated in (b, act) within their replay class."""
    n = len(b)
    if n == 1:
        return np.zeros(1, dtype=int)
    order = np.lexsort((act, b, replay))  # by class, then b, then act
    r, a = replay[order], act[order]
    cuts = np.flatnonzero(r[1:] != r[:-1]) + 1
    keep = []
    for lo, hi in zip([0, *cuts.tolist()], [*cuts.tolist(), n]):
        prev = np.empty(hi - lo)
        prev[0] = np.inf
        np.minimum.accumulate(a[lo:hi - 1], out=prev[1:])
        keep.append(order[lo:hi][a[lo:hi] < prev])
    return np.sort(np.concatenate(keep))


def _rank(mesh, pp, dp, tp):
    r, co = 0, {"pp": pp, "dp": dp, "tp": tp}
    for d in mesh.order:
        r = r * getattr(mesh, d) + co[d]
    return r
