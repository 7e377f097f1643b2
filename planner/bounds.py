"""Lower bounds of the search (planner.search's docstring): what a configuration's schedule holds
in flight, and for a whole configuration its step time and memory whatever the inner choice
(partition, ZeRO level and recomputation per stage).
"""
from __future__ import annotations

import math

import numpy as np

from planner.comm import gather_beside_forward, plays_last_backward, reduce_beside_backward
from planner.fsdp_memory import grads_sharded
from planner.layers import tied_head
from planner.memory import held_i_to_w_bytes
from planner.orders import interleaved_sequence, rank_order

TOL = 1e-9


def in_flight_counts(schedule: str, pp: int, v: int, micro_batches: int):
    """Per pipeline rank of `schedule`: the micro-batch count vectors after each forward (and I)
    with v > 1, one entry per chunk of its micro-batches from F to B (W), then one per chunk of
    those from I to W (none but under zbv), then one per chunk that is 1 once the chunk's first
    backward (W) has begun and its gradients exist (planner.orders.peak_with_gradients; also
    the counts just before each first backward); their maxima; and moments[e, r] (E, pp, 3 v):
    rank r's vector at E <= 6 of those moments (where the smallest F-to-W count of a chunk is
    largest, where the smallest I-to-W count is, where a chunk holds the most from F to W, where
    all chunks together hold the most, and the first and last of these among the moments with
    every gradient), from which balance_bound bounds the peak memory."""
    flight, maxcnt = [], []
    for r in range(pp):
        if v == 1:
            # without a pipeline micro-batches run one after another (gradient accumulation)
            n = 1 if pp == 1 else micro_batches if schedule == "gpipe" else min(pp - r, micro_batches)
            flight.append(np.array([[float(n)]]))
        else:
            # a chunk holds a micro-batch from its F to its B (a split backward: its W), and
            # under a split backward what W needs from its I to its W (the last v columns)
            if schedule == "interleaved-1f1b":
                forward, chunk, _ = interleaved_sequence(pp, v, micro_batches, r)
                kind = np.where(forward, "F", "B")
            else:
                ops = rank_order(schedule, pp, v, micro_batches, r)
                kind = np.array([k for k, _, _ in ops])
                chunk = np.array([s // pp for _, s, _ in ops])
            steps = np.zeros((len(kind), 3 * v))
            at = np.arange(len(kind))
            steps[at, chunk] = np.select([kind == "F", kind == "I"], [1.0, 0.0], -1.0)  # B, W: -1
            steps[at, v + chunk] = np.select([kind == "I", kind == "W"], [1.0, -1.0], 0.0)
            # a chunk's gradients from its first backward on (W under a split backward)
            back = np.flatnonzero((kind == "B") | (kind == "W"))
            firsts = back[np.unique(chunk[back], return_index=True)[1]]
            steps[firsts, 2 * v + chunk[firsts]] = 1.0
            after = np.cumsum(steps, axis=0)
            before = after.copy()  # a first backward still holds its micro-batch
            before[:, :2 * v] -= steps[:, :2 * v]
            counts = np.concatenate((after[(kind == "F") | (kind == "I")], before[firsts]))
            flight.append(_unique_rows(counts))
        maxcnt.append(flight[-1].max(axis=0))
    width = flight[0].shape[1]
    moments = np.zeros((6, pp, width))
    for r, f in enumerate(flight):
        lo_f = f[:, :v].min(axis=1)
        lo_w = f[:, v:2 * v].min(axis=1) if f.shape[1] > v else np.zeros(len(f))
        # and the same two where the rank has all its gradients (v > 1; every row for v = 1)
        full = np.flatnonzero((f[:, 2 * v:] > 0).all(axis=1))
        picks = (np.lexsort((lo_w, lo_f))[-1], np.lexsort((lo_f, lo_w))[-1], int(np.argmax(f[:, :v].max(axis=1))),
                 int(np.argmax(f[:, :2 * v].sum(axis=1))), full[np.lexsort((lo_w[full], lo_f[full]))[-1]],
                 full[int(np.argmax(f[full, :2 * v].sum(axis=1)))])
        for e, i in enumerate(picks):
            moments[e, r] = f[i]
    return flight, maxcnt, _unique_rows(moments)  # without repeats (one moment for v = 1)


def _unique_rows(a):
    """np.unique(a, axis=0) (its rows sorted, without repeats), faster for small arrays."""
    flat = a.reshape(len(a), -1)
    s = flat[np.lexsort(flat.T[::-1])]
    keep = np.ones(len(s), dtype=bool)
    keep[1:] = (s[1:] != s[:-1]).any(axis=1)
    return s[keep].reshape((-1, *a.shape[1:]))


class Bounds:
    """Mixed into planner.stages.StageCosts: bounds over every inner choice of one configuration."""

    def config_bound(self):
        """(lower bound on step time, lower bound on per-device memory) for any inner choice."""
        ctx, cfg, lc = self.ctx, self.cfg, self.lc
        w = lambda x: x.fwd_compute_s + x.bwd_compute_s + x.fwd_tp_s + x.bwd_tp_s
        wtot = w(lc["emb"]) + w(lc["head"]) + self.L * min(w(lc["blk"][r]) for r in self.modes)
        head = tied_head(ctx.model, lc["head"], cfg.tp) if ctx.model.tie_embeddings else lc["head"]  # at least
        P = lc["emb"].params + head.params + self.L * lc["blk"]["none"].params
        dp, mbs, p = cfg.shards, cfg.micro_batches, cfg.pp
        # LB2 averaged over ranks: every stage pays sync + optimizer + ZeRO-1/2 gather, affine in its
        # parameters (alpha + beta P), and for v = 1 each rank has one stage.
        rep = ctx.replicas(cfg)[0]  # HSDP: each stage's reduced shard all-reduced across the replicas
        segmented = not all(x.affine for op in ctx.cluster.collectives.values() for x in op.values())
        # the experts spread by expert parallelism reduce and gather over their own group, which may
        # be the cheaper per byte: a parameter at the cheaper of the two (a bound)
        groups = [ctx.collectives(cfg)[:3]] + ([ctx.experts(cfg)[:3]] if cfg.ep > 1 else [])

        def ab(pick):
            if segmented:
                return 0.0, 0.0
            lines = [(f(1.0) - (f(2.0) - f(1.0)), f(2.0) - f(1.0)) for f in map(pick, groups)]
            return min(a for a, _ in lines), min(b for _, b in lines)
        alphas, betas = [], []
        hidden = gather_beside_forward(ctx.train, ctx.cluster)  # ZeRO-1/2's gather: its exposed part may be 0
        synced = dp > 1 and not reduce_beside_backward(ctx.train, ctx.cluster)  # so may the gradients' reduction
        for z in self.zeros:
            a_s, b_s = ab(lambda g: g[1] if z == 0 else lambda n: g[2](n) + rep(n / dp)) if synced else (0.0, 0.0)
            a_g, b_g = ab(lambda g: g[0]) if (dp > 1 and z in (1, 2) and not hidden) else (0.0, 0.0)
            alphas.append((a_s + a_g) if cfg.v == 1 else 0.0)
            betas.append((b_s * ctx.gb if cfg.v == 1 else 0.0) + b_g * ctx.e
                         + ctx.osb / ctx.bw / (dp if z >= 1 else 1))
        lb = (mbs * wtot + p * min(alphas) + P * min(betas)) / p
        if cfg.v == 1 and not synced and dp > 1 and cfg.ep == 1 and ctx.steal > 0:
            # the reduction beside each stage's last backward slows it (planner.menus: by steal x the
            # parts before the last, or that backward's rest if shorter); of a stage of n blocks at
            # least n - 1 blocks' parts and n - 1 blocks' backward (one may hold the last part and
            # the layer before the first part), summed over the ranks at least (L - p) of the least
            # of a block's part and backward, averaged as LB2
            back = min(x.bwd_compute_s + x.bwd_tp_s for x in (lc["blk"][r] for r in self.modes))
            part = min(groups[0][1 if z == 0 else 2](lc["blk"]["none"].params * ctx.gb) for z in self.zeros)
            lb += ctx.steal * max(0, self.L - p) * min(part, back) / p
        if cfg.v == 1 and p > 1:
            lb = max(lb, wtot / (1.0 - (1.0 - 1.0 / mbs) ** p))
        elif cfg.v > 1:  # micro-batch 0 runs forward through every stage, and (not split) back
            f = lambda x: x.fwd_compute_s + x.fwd_tp_s  # noqa: E731
            lb = max(lb, f(lc["emb"]) + f(lc["head"]) + self.L * min(f(lc["blk"][r]) for r in self.modes)
                     if self.split else wtot)
        if self.share:  # the whole model's work on shared compute (evaluate)
            lb = max(lb, mbs * wtot / self.share)
        state = min(sum(self._state(z)) for z in self.zeros)
        # the busiest rank holds at least the average of every rank's state and receive buffers
        return lb, P * state / p + self.act_grad + float(self._recv_by_rank().mean())

    def balance_bound(self, bound=math.inf):
        """A lower bound on max_r (m W_r + what rank r adds once a step), m micro-batches of per
        micro-batch work W_r (the LB of planner.search's docstring), that respects memory, or inf
        when no partition can fit. Relaxation: a rank takes a whole number of blocks, but may mix
        recompute modes in any proportion. At each moment of in_flight_counts a rank's block is
        held at least as long as the rank's least held chunk holds it (kappa), and every chunk but the
        first and last stage has a block held as long as its own chunk holds it; a rank holds its
        blocks' ZeRO state (with v > 1 chunks, without the gradients at moments before every
        chunk's first backward), the embedding or head where its chunks have them, and its
        receive buffers. At ZeRO level z a block costs per micro-batch at least its compute and TP
        time t_i plus c_z, and at least g_z (_zero_terms: FSDP2's copies, the step's terms over the m
        micro-batches, the ZeRO-3 gathers and ZeRO-2/3 reduce-scatters a block waits for). For a
        per-rank work budget U, rank r can take at most max n0 + n1 + n2 s.t. sum n_i (t_i + c_z)
        <= U - its ends' work, sum n_i (s_z + kappa_r a_i) <= what its memory leaves (an LP whose
        optimum uses at most two modes), and at most (U - its ends') / g_z blocks, rounded down;
        each rank at its best level for v = 1 (one stage a rank), every term at its least over the
        levels for v > 1 (a rank's chunks may differ). The smallest U that places all L blocks is searched
        on a geometric grid, then two linear ones (tests/test_bounds.py checks it against every
        assignment of small cases)."""
        ctx, cfg, lc = self.ctx, self.cfg, self.lc
        p, v = cfg.pp, cfg.v
        _, _, moments = ctx.in_flight(cfg)
        F = moments[:, :, :v]  # (moments, ranks, chunks): micro-batches held from F to B (W)
        if self.fb:  # a rank peaking in its first backward holds at least one micro-batch fewer
            # beside every gradient (planner.memory.first_backward_bytes): one fewer counted here
            F = np.maximum(F - np.array(self.first_b, dtype=float)[None, :, None], 0.0)
        W = moments[:, :, v:2 * v] if moments.shape[2] > v else np.zeros_like(F)  # from I to W
        # with v > 1 chunks a rank has all its gradients only once every chunk's first backward has
        # begun (planner.orders.peak_with_gradients): before, a block's state is counted without
        # them (a lower bound: a chunk with gradients holds more)
        all_grads = (moments[:, :, 2 * v:] > 0).all(axis=2) if v > 1 else np.ones(F.shape[:2], dtype=bool)
        blk = [lc["blk"][r] for r in self.modes]
        t0 = np.array([x.fwd_compute_s + x.bwd_compute_s + x.fwd_tp_s + x.bwd_tp_s for x in blk])
        a = np.array([x.activation_bytes for x in blk])
        tokens = cfg.rank_micro_batch * ctx.train.seq_len  # held from I to W per block (menu's held_iw)
        h = np.array([held_i_to_w_bytes(ctx.model, 1, cfg.tp, tokens, ctx.e, x.replay_bytes, r, cfg.sp)
                      for r, x in zip(self.modes, blk)])
        mbs = cfg.micro_batches
        M = ctx.lim_eff * (1 + TOL) - self.act_grad - self._recv_by_rank()  # per rank
        if (M <= 0).any():  # every rank holds those
            return math.inf
        tp_min = min(x.fwd_tp_s + x.bwd_tp_s for x in blk)
        tp_f, tp_b = min(x.fwd_tp_s for x in blk), min(x.bwd_tp_s for x in blk)
        terms = self._zero_terms()
        if v > 1:  # a rank's chunks may differ in ZeRO level: each term at its least
            terms = [tuple(min(x[j] for x in terms) for j in range(5))]
        # a block is held at least as long as the rank's least held chunk holds it (kappa); every
        # chunk but the first and last stage has a block (k_range), held as long as its chunk
        # holds it: n_first blocks a rank must take, and at least what they hold beyond kappa
        first = np.array([[0 < s < self.S - 1 for s in self.stages_of[r]] for r in range(p)], dtype=float)
        n_first = first.sum(axis=1)
        kap_f, kap_w = F.min(axis=2), W.min(axis=2)  # (moments, ranks)
        beyond = (F - kap_f[..., None])[..., None] * a + (W - kap_w[..., None])[..., None] * h
        first_mem = (first[None, :, :, None] * beyond).min(axis=3).sum(axis=2)
        # the embedding and the head, on the ranks of the first and last stage: their work, and
        # their ZeRO state, activations and what they hold from I to W, beside the blocks
        end_t, end_p, end_tp, end_mem = np.zeros(p), np.zeros(p), np.zeros((2, p)), first_mem
        head = tied_head(ctx.model, lc["head"], cfg.tp) if ctx.model.tie_embeddings else lc["head"]  # at least
        for x, s, j in ((lc["emb"], 0, 0), (head, self.S - 1, self.L + 1)):
            r, c = self.rank_of[s], self.stages_of[self.rank_of[s]].index(s)
            end_t[r] += x.fwd_compute_s + x.bwd_compute_s + x.fwd_tp_s + x.bwd_tp_s
            end_tp[:, r] += x.fwd_tp_s, x.bwd_tp_s
            end_p[r] += x.params
            held = held_i_to_w_bytes(ctx.model, j, cfg.tp, tokens, ctx.e, 0.0, "none", cfg.sp) if self.split else 0.0
            end_mem[:, r] += F[:, r, c] * x.activation_bytes + W[:, r, c] * held
        # the loss's forward holds its logits where a backward holds the activation gradients (M)
        end_mem[:, self.rank_of[-1]] += max(0.0, self.head_logits - self.act_grad)
        # rank r starts once micro-batch 0's forward has come through stages 0..r-1 (its ranks'
        # first chunks: the embedding, and a block each but the first), and all its work follows.
        # Under interleaved 1F1B its last work is its first chunk's backward of the last
        # micro-batch (planner.orders.interleaved_sequence), which then runs back through those
        # stages before rank 0 ends, and every rank's step terms (c) wait for that (planner.cost:
        # the gradient norm over the pipeline ranks); with one stage a rank c holds its gradient
        # sync, which does not wait
        drain = v > 1 and not self.split
        chain = lambda x: (x.fwd_compute_s + x.fwd_tp_s  # noqa: E731
                           + (x.bwd_compute_s + x.bwd_tp_s if drain else 0.0))
        f_blk = min(chain(x) for x in blk)
        f_emb = chain(lc["emb"])
        first = [(f_emb if s == 0 else 0.0) + (f_blk if 0 < s < self.S - 1 else 0.0) for s in range(p - 1)]
        fill = np.concatenate(([0.0], np.cumsum(first))) / mbs
        end_t, end_tp[0] = end_t + fill, end_tp[0] + fill
        pairs = [(i, j) for i in range(len(t0)) for j in range(i + 1, len(t0))]
        # every ZeRO level at once (the first axis of each array)
        cs, gs, full, bare, kb = (np.array(x) for x in zip(*terms))
        state = np.where(all_grads[None], full[:, None, None], bare[:, None, None])  # (levels, moments, ranks)
        P = blk[0].params
        # the TP time a block's communication bound counts: a last backward that plays its
        # gathers and reduction (_zero_terms' kb < 1) may run its TP collectives beside them
        t, gb = t0[None, :] + cs[:, None] * P, (gs + cs) * P + np.where(kb < 1, tp_f + kb * tp_b, tp_min)
        # (levels, moments, ranks, modes): each moment's memory is a constraint; a rank takes at
        # most the least any of them allows
        mem = state[..., None] * P + kap_f[None, ..., None] * a + kap_w[None, ..., None] * h
        room = M[None, None, :] - state * end_p[None, None, :] - end_mem[None]  # (levels, moments, ranks)
        off_t = end_t[None, :] + cs[:, None] * end_p[None, :]
        off_g = end_tp[0][None, :] + kb[:, None] * end_tp[1][None, :] + (gs + cs)[:, None] * end_p[None, :]
        holds = (room >= 0).all(axis=1)  # (levels, ranks): the level holds the rank's ends
        if not holds.any(axis=0).all():
            return math.inf  # a rank cannot hold its embedding, head or its chunks' first blocks

        def cap(U):
            """Blocks all ranks can take within each work budget of the array U."""
            with np.errstate(all="ignore"):  # a profile's tiny rates overflow to inf: priced as unusable
                U = np.asarray(U, dtype=float)
                Ut = U[None, :, None, None] - off_t[:, None, None, :]  # (levels, budgets, moments, ranks)
                best = np.max(np.minimum(Ut[..., None] / t[:, None, None, None, :],
                                         room[:, None, :, :, None] / mem[:, None]), axis=-1)
                room_b = room[:, None]
                for i, j in pairs:  # both constraints tight: solve for n_i, n_j
                    ti, tj = t[:, i, None, None, None], t[:, j, None, None, None]
                    mi, mj = mem[:, None, :, :, i], mem[:, None, :, :, j]
                    det = ti * mj - tj * mi
                    ni = (Ut * mj - tj * room_b) / det
                    nj = (ti * room_b - Ut * mi) / det
                    ok = (det != 0) & (ni >= 0) & (nj >= 0)  # not ok: an infinite or NaN n_i + n_j goes unused
                    best = np.where(ok, np.maximum(best, ni + nj), best)
                best = np.maximum(best, 0.0).min(axis=2)  # (levels, budgets, ranks)
                comm = (U[None, :, None] - off_g[:, None, :]) / gb[:, None, None]
                best = np.where(gb[:, None, None] > 0, np.minimum(best, comm), best)
                best = np.floor(best * (1 + 1e-9) + 1e-9)  # whole blocks: a block is one stage's
                best = np.where(best >= n_first * (1 - 1e-9), best, -np.inf)  # its chunks' first blocks
                best = np.where(holds[:, None, :], best, -np.inf)  # this level cannot hold the ends
                return best.max(axis=0).sum(axis=1)

        need = self.L * (1 - 1e-9)
        top = (np.maximum(t.max(axis=1), gb) * self.L + np.maximum(off_t.max(axis=1), off_g.max(axis=1))).max()
        probe = [top * 2] + ([bound / mbs] if math.isfinite(bound) else [])
        caps = cap(probe)
        if caps[0] < need:
            return math.inf
        if len(caps) > 1 and caps[1] < need:
            return bound  # cannot beat the incumbent: that is all the caller needs to know
        # the smallest budget that places all L blocks (the largest infeasible one found): it lies
        # between the ranks' average least work and 2 top (feasible), searched on a geometric grid
        # of 16, then two linear ones
        least = t.min() * self.L + off_t.min(axis=0).sum()
        lo, hi = max(least / p, top * 1e-6), 2 * top
        for n in range(3):
            grid = lo * (hi / lo) ** (np.arange(1, 17) / 16) if n == 0 else lo + (hi - lo) * np.arange(1, 17) / 16
            ok = np.flatnonzero(cap(grid) >= need)
            lo, hi = (grid[ok[0] - 1] if ok[0] else lo), grid[ok[0]]
        return mbs * lo

    def _zero_terms(self):
        """Per allowed ZeRO level and per parameter: (c, g, state, state without gradients, kb) of
        balance_bound: seconds per micro-batch every block adds (FSDP2's copies; the step's
        optimizer, ZeRO-1/2 gather and, for v = 1, gradient sync, over m micro-batches; under zbv's
        split backward the two ZeRO-3 gathers, exposed), the communication a block's forward and
        backward wait for (the menus' max(compute, gather) and max(compute, what runs beside the
        backward), planner.stages.menu), the ZeRO state bytes with and without the gradients', and
        the share of a block's backward TP time g may add to: 1, or (m - 1) / m where the stage's
        last backward plays ZeRO 2/3's gathers and reduce-scatters (planner.menus: its TP
        collectives and FSDP2's copies may run beside them, so g leaves that backward's copies
        out). Collectives at their latency-free slope (ClusterSpec.seconds_per_byte), a lower bound
        of their time."""
        ctx, cfg = self.ctx, self.cfg
        dp, mbs, e = cfg.shards, cfg.micro_batches, ctx.e
        # over the shard group, or the experts' own where cheaper (config_bound)
        shapes = [ctx.collectives(cfg)[3]] + ([ctx.experts(cfg)[3]] if cfg.ep > 1 else [])
        slope = ((lambda op: min(ctx.cluster.seconds_per_byte(op, sh) for sh in shapes)) if dp > 1  # noqa: E731
                 else (lambda op: 0.0))
        s_ag, s_ar, s_rs = slope("all_gather"), slope("all_reduce"), slope("reduce_scatter")
        rep_shape = ctx.replicas(cfg)[1]  # HSDP: the shard all-reduced across the replicas once a step
        s_rep = ctx.cluster.seconds_per_byte("all_reduce", rep_shape) * ctx.gb / dp if rep_shape else 0.0
        out = []
        hidden = gather_beside_forward(ctx.train, ctx.cluster)  # ZeRO-1/2's gather (config_bound)
        beside_b = reduce_beside_backward(ctx.train, ctx.cluster)  # and the gradients' reduction
        for z in self.zeros:
            state, (copy_f, copy_b, copy_s) = self._per_param(z)
            ag = s_ag * e if z == 3 else 0.0
            sync = (s_ar if z == 0 else s_rs) * ctx.gb
            beside = ag + sync if (dp > 1 and mbs > 1 and grads_sharded(z, mbs, ctx.train.defer_grad_sync)) else ag
            step = ctx.osb / ctx.bw / (dp if z >= 1 else 1) + copy_s + (s_ag * e if z in (1, 2) and not hidden else 0.0)
            if cfg.v == 1 and not beside_b:  # evaluate counts a rank's first stage's sync (HSDP: and the replicas')
                step += sync + (s_rep if z >= 1 else 0.0)
            w = ctx.work  # in a forward or backward, as work (planner.menus: shared compute)
            c = w * (copy_f + copy_b) + step / mbs
            bare = state - self._state(z)[1]
            played = plays_last_backward(ctx.train, ctx.cluster, z, dp, mbs, self.split)
            kb = (mbs - 1) / mbs if played else 1.0
            if self.split and z >= 2 and dp > 1:  # planner.cost: I and W each gather, exposed
                out.append((c + 2 * w * ag, 0.0, state, bare, kb))
            else:
                # with c (g adds to c), less the last backward's copies where it plays (they run beside)
                out.append((c, w * (ag + beside) - (w * copy_b / mbs if played else 0.0), state, bare, kb))
        return out
