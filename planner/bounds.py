"""Lower bounds of the search (planner.search's docstring): what a configuration's schedule holds
in flight, and for a whole configuration its step time and memory whatever the inner choice
(partition, ZeRO level and recomputation per stage).
"""
from __future__ import annotations

import math

import numpy as np

from planner.cost import tied_head
from planner.memory import held_i_to_w_bytes
from planner.schedule import rank_order

TOL = 1e-9


def in_flight_counts(schedule: str, pp: int, v: int, micro_batches: int):
    """Per pipeline rank of `schedule`: the micro-batch count vectors after each forward (and I)
    with v > 1, one entry per chunk of its micro-batches from F to B (W), then one per chunk of
    those from I to W (none but under zbv); their maxima; and kappa[e, r] = (smallest of the first v
    entries, smallest of the last v) at two moments e: where the first is largest and where the
    second is (so that the peak activation memory is at least kappa[e, r, 0] x the rank's
    activations of one micro-batch plus kappa[e, r, 1] x what it holds from I to W)."""
    flight, maxcnt = [], []
    for r in range(pp):
        if v == 1:
            # without a pipeline micro-batches run one after another (gradient accumulation)
            n = 1 if pp == 1 else micro_batches if schedule == "gpipe" else min(pp - r, micro_batches)
            flight.append(np.array([[float(n)]]))
        else:
            # a chunk holds a micro-batch from its F to its B (a split backward: its W), and
            # under a split backward what W needs from its I to its W (the last v columns)
            ops = rank_order(schedule, pp, v, micro_batches, r)
            kind = np.array([k for k, _, _ in ops])
            chunk = np.array([s // pp for _, s, _ in ops])
            steps = np.zeros((len(ops), 2 * v))
            at = np.arange(len(ops))
            steps[at, chunk] = np.select([kind == "F", kind == "I"], [1.0, 0.0], -1.0)  # B, W: -1
            steps[at, v + chunk] = np.select([kind == "I", kind == "W"], [1.0, -1.0], 0.0)
            counts = np.cumsum(steps, axis=0)[(kind == "F") | (kind == "I")]
            flight.append(np.unique(counts, axis=0))
        maxcnt.append(flight[-1].max(axis=0))
    # (smallest F-to-W count, smallest I-to-W count) per rank at two moments: where the first
    # is largest, and (a split backward) where the second is
    kappa = np.zeros((2, pp, 2))
    for r, f in enumerate(flight):
        lo_f = f[:, :v].min(axis=1)
        lo_w = f[:, v:].min(axis=1) if f.shape[1] > v else np.zeros(len(f))
        for e, i in enumerate((np.lexsort((lo_w, lo_f))[-1], np.lexsort((lo_f, lo_w))[-1])):
            kappa[e, r] = lo_f[i], lo_w[i]
    return flight, maxcnt, kappa


class Bounds:
    """Mixed into planner.stages.StageCosts: bounds over every inner choice of one configuration."""

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
        # the busiest rank holds at least the average of every rank's state and receive buffers
        return lb, P * state / p + self.act_grad + float(self._recv_by_rank().mean())

    def balance_bound(self, bound=math.inf):
        """A lower bound on m x (the busiest rank's work per micro-batch) that respects memory, or inf
        when no partition can fit. Relaxation: blocks may be split fractionally over ranks and
        take any recompute mode; rank r holds at least kappa_r micro-batches of its activations and
        at least the cheapest ZeRO state of its parameters (and, under zbv, kappa[e, r, 1]
        micro-batches of what it holds from I to W), beside its receive buffers. For a per-rank
        work budget U, rank r can take at most max n0 + n1 + n2 s.t. sum n_i t_i <= U,
        sum n_i (s + kappa_r a_i) <= M_r (an LP whose optimum uses at most two modes); the smallest
        U that places all L blocks is found on three successive grids of 16."""
        ctx, cfg, lc = self.ctx, self.cfg, self.lc
        _, _, kappa = ctx.in_flight(cfg)
        blk = [lc["blk"][r] for r in self.modes]
        t = np.array([x.fwd_compute_s + x.bwd_compute_s + x.fwd_tp_s + x.bwd_tp_s for x in blk])
        a = np.array([x.activation_bytes for x in blk])
        tokens = cfg.micro_batch * ctx.train.seq_len  # held from I to W per block (menu's held_iw)
        h = np.array([held_i_to_w_bytes(ctx.model, 1, cfg.tp, tokens, ctx.e, x.replay_bytes, r)
                      for r, x in zip(self.modes, blk)])
        mbs = cfg.micro_batches
        state = min(sum(self._state(z)) for z in self.zeros) * blk[0].params
        M = ctx.lim_eff * (1 + TOL) - self.act_grad - self._recv_by_rank()  # per rank
        # (moments, ranks, modes): each moment's memory is a constraint; a rank takes at most the
        # least any of them allows
        mem = state + kappa[:, :, :1] * a[None, None, :] + kappa[:, :, 1:] * h[None, None, :]
        pairs = [(i, j) for i in range(len(t)) for j in range(i + 1, len(t))]

        def cap(U):
            """Blocks all ranks can take within each work budget of the array U."""
            U = np.asarray(U, dtype=float)[:, None, None]  # (budgets, moments, ranks)
            best = np.max(np.minimum(U[..., None] / t, M[None, None, :, None] / mem), axis=3)
            for i, j in pairs:  # both constraints tight: solve for n_i, n_j
                det = t[i] * mem[:, :, j] - t[j] * mem[:, :, i]
                with np.errstate(divide="ignore", invalid="ignore"):
                    ni = (U * mem[:, :, j] - t[j] * M) / det
                    nj = (t[i] * M - U * mem[:, :, i]) / det
                ok = (det != 0) & (ni >= 0) & (nj >= 0)
                best = np.where(ok, np.maximum(best, ni + nj), best)
            return np.maximum(best, 0.0).min(axis=1).sum(axis=1)

        need = self.L * (1 - 1e-9)
        probe = [t.max() * self.L * 2] + ([bound / mbs] if math.isfinite(bound) else [])
        caps = cap(probe)
        if (M <= 0).any() or caps[0] < need:  # every rank holds those
            return math.inf
        if len(caps) > 1 and caps[1] < need:
            return bound  # cannot beat the incumbent: that is all the caller needs to know
        # the smallest budget that places all L blocks, to 1/16^3 of the range (largest infeasible)
        lo, hi = 0.0, t.max() * self.L
        for _ in range(3):
            grid = lo + (hi - lo) * np.arange(1, 17) / 16
            ok = np.flatnonzero(cap(grid) >= need)
            if not len(ok):
                lo = hi
                break
            lo, hi = (grid[ok[0] - 1] if ok[0] else lo), grid[ok[0]]
        return mbs * lo

