"""The inner problem of the search, for one mesh and schedule configuration: the layer partition
into pp * v stages and, per stage, its ZeRO level and how many of its blocks are recomputed fully,
selectively or not at all (blocks are identical, so only the counts matter).

Stage options and their costs are planner.stages'.

Candidates: every partition x option assignment when there are few (`exhaustive_limit`), which is
exact; otherwise a dynamic programme over stages in which each (stage, block count) takes its
cheapest option that fits (a Galvatron-style knapsack over recompute counts): a min-max pass gives
the best bottleneck T*, min-sum passes under thresholds T >= T* (Alpa's enumeration of the
bottleneck) give more partitions, a local search moves blocks between neighbouring stages to
account for the pipeline's fill and drain, the best are also tried with one ZeRO level
throughout, and the even split with one ZeRO level and recompute mode throughout is always a
candidate. With v > 1 the DP gives each chunk 1/v of its rank's memory (safe, not exact); every
candidate's memory is then checked exactly (the schedule's micro-batches in flight per chunk).
With v > 1 the full sweep also balances ranks rather than stages (planner.rank_split: a rank's chunks
summed, under the sweep's first bottlenecks as caps on a stage), which the stage-level min-max
and the one-block polish do not reach where balancing takes moving blocks across several ranks;
the quick pass (planner.search's key) tries the one at the best bottleneck too.
Each candidate gets the lower bound LB of planner.search's docstring.
"""
from __future__ import annotations

import itertools
import math

import numpy as np

from planner.memory import first_backward_peak
from planner.model import RECOMPUTE_MODES
from planner.plan import Plan, Stage
from planner.build import even_stages
from planner.rank_split import rank_split
from planner.stages import TOL, StageCosts


class Inner(StageCosts):
    """One configuration: candidate assignments (partition + per-stage options) and their plans."""

    # -------------------------------------------------------------- candidates
    def k_range(self, s, kcap):
        if self.S == 1:
            return [self.L] if self.L <= kcap else []
        lo = 0 if s in (0, self.S - 1) else 1
        hi = self.L if self.L <= 48 else min(self.L, 2 * math.ceil(self.L / self.S) + 2)
        return list(range(lo, min(hi, kcap) + 1))

    def options(self, kcap, share=False):
        """opts[s][k] = (menu, option indices whose memory can fit, sorted by c). With v > 1 a rank's
        memory depends on all its chunks: without `share` an option is kept when it fits on its own
        (necessary), with `share` only when it fits in 1/v of the rank's budget (sufficient)."""
        cfg, ctx = self.cfg, self.ctx
        opts = [dict() for _ in range(self.S)]
        groups: dict = {}
        for s in range(self.S):
            groups.setdefault(self.flags(s), []).append(s)
        for flags, ss in groups.items():
            # stages alike in what bounds their memory (micro-batches in flight, a first backward
            # that binds) have the same options: each such kind once
            alike = [(self.maxcnt[self.rank_of[s]][s // cfg.pp], self.fb and self.first_b[self.rank_of[s]]) for s in ss]
            kinds = sorted(set(alike))
            of_kind = [[s for s, a in zip(ss, alike) if a == kind] for kind in kinds]
            cnt = np.array([c for c, _ in kinds])[:, None]
            if cfg.v == 1 or not share:
                extra, lim = self.act_grad, ctx.lim_eff * (1 + TOL)
            else:
                extra, lim = 0.0, (ctx.lim_eff - self.act_grad) / cfg.v * (1 + TOL)
            kr = {s: set(self.k_range(s, kcap)) for s in ss}
            ks = sorted(set().union(*kr.values()))
            menus = self.menus(ks, *flags)
            fb = np.array([b for _, b in kinds])[:, None] if self.fb else None
            for k in ks:
                mn = menus[k]
                order, (fixed_rep, act) = mn["order"], mn["mem_sorted"]  # options by c, their memory parts
                held = cnt * act[None, :]
                if fb is not None:  # ranks whose first backward holds the most (StageCosts.evaluate)
                    grads, first = mn["first_sorted"]
                    held = np.where(fb, first_backward_peak(held, act, grads, first) - grads, held)
                elif cfg.v > 1 and not share:  # at its most in flight a chunk may have no gradients yet
                    held = np.maximum(held - mn["first_sorted"][0][None, :], 0.0)
                fits = (fixed_rep + extra)[None, :] + held <= lim
                anyfit = fits.any(axis=1)
                for i, same in enumerate(of_kind):
                    if anyfit[i]:
                        ok = order[fits[i]]
                        for s in same:
                            if k in kr[s]:
                                opts[s][k] = (mn, ok)
        return opts

    def candidates(self, bound=math.inf, quick=False):
        """[(LB, assignment)] for this configuration, assignment = [(k, menu, option)], leaving out
        what provably cannot beat `bound` (a stage of k blocks takes at least m k w_block)."""
        lc, mbs = self.lc, self.cfg.micro_batches
        self.rank_balanced = []  # _dp's rank-balanced splits (planner.rank_split), [(LB, assignment)]
        wblk = min(x.fwd_compute_s + x.bwd_compute_s + x.fwd_tp_s + x.bwd_tp_s for x in lc["blk"].values())
        kcap = self.L if not math.isfinite(bound) or wblk <= 0 else int(bound / (mbs * wblk) * (1 + TOL)) + 1
        self.exhaustive = True
        if self.ctx.space.uneven and self.S > 1 and math.comb(self.L + 1, self.S - 1) > 100 * self.ctx.space.exhaustive_limit:
            self.exhaustive = False  # far too many partitions to enumerate, whatever fits
            return self._dp(self.options(kcap, share=self.cfg.v > 1), bound, quick) + \
                ([] if quick and self.cfg.v == 1 else self._uniform())
        limit = self.ctx.space.exhaustive_limit
        if self.ctx.space.uneven and self.cfg.v > 1:  # the options that fit in 1/v of a rank (a subset) first:
            shared = self.options(kcap, share=True)  # more assignments than the limit of those, not exhaustive
            if self._count(shared) > limit:
                self.exhaustive = False
                return self._dp(shared, bound, quick) + self._uniform()
        opts = self.options(kcap)
        if not self.ctx.space.uneven:
            sizes = self._even_sizes()
            if any(k not in opts[i] for i, k in enumerate(sizes)):
                return []
            if math.prod(len(opts[i][k][1]) for i, k in enumerate(sizes)) <= self.ctx.space.exhaustive_limit:
                return self._enumerate(opts, fixed_sizes=sizes)
            self.exhaustive = False
            alts = [a for z in (None, *self.zeros) for a in [self._assign(opts, sizes, z)] if a]
            return [(lb, a) for a, lb in zip(alts, self.evaluate_many(alts)) if lb is not None]
        self.exhaustive = self._count(opts) <= limit
        if self.exhaustive:
            return self._enumerate(opts)
        if self.cfg.v == 1:
            return self._dp(opts, bound, quick) + ([] if quick else self._uniform())
        return self._dp(shared, bound, quick) + self._uniform()

    def _count(self, opts) -> float:
        """How many assignments (partition and options) `opts` allows."""
        count = np.zeros(self.L + 1)  # assignments per blocks used so far
        count[0] = 1.0
        for s in range(self.S):
            new = np.zeros(self.L + 1)
            for k, (_, ok) in opts[s].items():
                new[k:] += count[:self.L + 1 - k] * len(ok)
            count = new
        return count[self.L]

    def _uniform(self):
        """The even split with one ZeRO level and one recompute mode throughout (the least
        recomputation that fits): a safety net for the DP, which prices stages by c rather than by
        the schedule and, for v > 1, splits a rank's memory evenly over its chunks."""
        kinds = [(k, *self.flags(s)) for s, k in enumerate(self._even_sizes())]  # (blocks, embedding, head)
        menus = {key: self._uniform_options(*key) for key in set(kinds)}
        tries = []
        for z in self.zeros:
            for mode in [x for x in RECOMPUTE_MODES if x in self.modes]:
                picks = {key: memo.get((z, mode)) for key, (_, memo) in menus.items()}
                if all(i is not None for i in picks.values()):
                    tries.append((z, [(key[0], menus[key][0], picks[key]) for key in kinds]))
        out, done = [], set()
        for (z, assign), lb in zip(tries, self.evaluate_many([a for _, a in tries])):
            if lb is not None and z not in done:  # at each level the least recomputation that fits
                out.append((lb, assign))
                done.add(z)
        return out

    def _even_sizes(self):
        """Blocks of each stage of the even split (planner.build.even_stages), once per search."""
        key = (self.cfg.pp, self.cfg.v)
        if key not in self.ctx._even:
            self.ctx._even[key] = [st.num_layers - (st.start == 0) - (st.end == self.L + 2)
                                   for st in even_stages(self.ctx.model, self.cfg.pp, self.cfg.v)]
        return self.ctx._even[key]

    def _uniform_options(self, k, emb, head):
        """(menu, {(ZeRO level z, mode): option}) of a stage of k blocks: the option of all blocks in
        `mode` at level z, or (when that combination was dropped as dominated) the fastest at z
        holding no more activations and replay."""
        mn = self.menu(k, emb, head)
        if "uniform" not in mn:  # the menu's key fixes everything but (z, mode): all of them at once
            memo = mn["uniform"] = {}
            levels = mn["zero"]
            cuts = np.flatnonzero(np.diff(levels)) + 1  # a menu's options are grouped by ZeRO level
            spans = list(zip(np.concatenate(([0], cuts)), np.concatenate((cuts, [len(levels)]))))
            _, _, _, blk_act, blk_rep, *_ = self.blocks(k)
            for m in self.modes:
                want = np.array([k if RECOMPUTE_MODES[j] == m else 0 for j in range(3)])
                combo = np.nonzero((mn["cb"] == want).all(axis=1))[0]
                if not len(combo):
                    continue
                act = blk_act[combo[0]] + (mn["act"][0] - blk_act[mn["combo"][0]])  # + embedding / head
                ok = (mn["act"] <= act * (1 + TOL)) & (mn["replay"] <= blk_rep[combo[0]])
                b = np.where(ok, mn["b"], np.inf)
                for i, j in spans:
                    best = i + int(np.argmin(b[i:j]))
                    if ok[best]:
                        memo[(int(levels[i]), m)] = best
        return mn, mn["uniform"]

    def _enumerate(self, opts, fixed_sizes=None):
        leaves = []
        reach = [set() for _ in range(self.S + 1)]  # blocks used before stage s from which L is reachable
        reach[self.S].add(self.L)
        for s in range(self.S - 1, -1, -1):
            ks = [fixed_sizes[s]] if fixed_sizes else list(opts[s])
            reach[s] = {j - k for j in reach[s + 1] for k in ks if k in opts[s] and j - k >= 0}

        def rec(s, used, acc):
            if s == self.S:
                if used == self.L:
                    leaves.append(list(acc))
                return
            ks = [fixed_sizes[s]] if fixed_sizes else opts[s]
            for k in ks:
                if k not in opts[s] or used + k not in reach[s + 1]:
                    continue
                mn, ok = opts[s][k]
                for i in ok:
                    acc.append((k, mn, int(i)))
                    rec(s + 1, used + k, acc)
                    acc.pop()
        rec(0, 0, [])
        return [(lb, a) for a, lb in zip(leaves, self.evaluate_many(leaves)) if lb is not None]

    def _dp(self, opts, bound=math.inf, quick=False):
        S, L = self.S, self.L
        INF = math.inf
        cost = np.full((S, L + 1), INF)
        for s in range(S):
            for k, (mn, ok) in opts[s].items():
                cost[s, k] = mn["c"][ok[0]]

        cols = np.arange(L + 1)
        ks_of = [np.array(sorted(opts[s]), dtype=int) if opts[s] else np.array([0]) for s in range(S)]
        for s in range(S):
            if not opts[s]:
                cost[s, 0] = INF

        reads = [L + cols[None, :] - ks[:, None] for ks in ks_of]  # per stage: the pad entries of each (k, blocks)

        def run(T=None):
            """min-max (T None) or min-sum under threshold T; returns (value, sizes)."""
            c = cost if T is None else np.where(cost <= T * (1 + TOL), cost, INF)
            pad = np.full(2 * L + 1, INF)  # pad[L + j] = value after the previous stages with j blocks
            pad[L] = 0.0
            back = np.zeros((S, L + 1), dtype=int)
            for s in range(S):
                ks = ks_of[s]
                prev = pad[reads[s]]  # (len(ks), L + 1)
                cand = np.maximum(prev, c[s, ks][:, None]) if T is None else prev + c[s, ks][:, None]
                arg = cand.argmin(axis=0)
                pad[L:] = cand[arg, cols]
                back[s] = ks[arg]
            val = pad[L:]
            if not np.isfinite(val[L]):
                return INF, None
            sizes, j = [], L
            for s in range(S - 1, -1, -1):
                sizes.append(int(back[s, j]))
                j -= sizes[-1]
            return val[L], sizes[::-1]

        tstar, sizes = run()
        if sizes is None or (self.cfg.v == 1 and self.L <= 48 and tstar >= bound * (1 - TOL)):
            return []  # for v = 1 every stage's c is a lower bound, so T* is one for the configuration
        finite = np.unique(cost[np.isfinite(cost)])
        Ts = finite[(finite >= tstar * (1 - TOL)) & (finite <= tstar * 1.5)]
        if len(Ts) > 12:
            Ts = Ts[np.unique(np.linspace(0, len(Ts) - 1, 12).astype(int))]
        seen, sweep = set(), []

        def add(sz, into):  # a split (block counts) not seen yet, assigned its options
            if sz is not None and tuple(sz) not in seen:
                seen.add(tuple(sz))
                into.append(self._assign(opts, sz))
        for T in [tstar] if quick else [tstar, *Ts]:
            add(run(T)[1], sweep)
        if quick and self.cfg.v > 1 and self.ctx.space.quick_rank_split:
            # several chunks a rank: the stage-level min-max can load a rank with two heavy chunks,
            # so the split that balances ranks at T* too (one split; polished below if among the best two)
            add(rank_split(cost, self.L, self.stages_of, tstar), sweep)
        out = [(lb, a) for a, lb in zip(sweep, self.evaluate_many(sweep)) if lb is not None]
        if quick and self.cfg.v == 1:
            return out
        # quick, several chunks a rank: the split at T* polished (its min-max ignores that a rank
        # holds several chunks and the schedule's fill), else the search keys the configuration by a
        # split far slower than its best (planner.search)
        alts = []
        for lb, assign in ([] if quick else sorted(out, key=lambda x: x[0])[:2]):  # the same with one ZeRO level throughout
            for z in self.zeros:
                alt = self._assign(opts, [k for k, _, _ in assign], z)
                if alt and [i for _, _, i in alt] != [i for _, _, i in assign]:
                    alts.append(alt)
        out += [(lb, a) for a, lb in zip(alts, self.evaluate_many(alts)) if lb is not None]
        if S <= 16:  # the DP ignores the pipeline's fill and drain: polish the best by moving blocks
            for lb, assign in [x for x in sorted(out, key=lambda x: x[0])[:2] if x[0] < bound * 1.1]:
                self._polish(opts, lb, [k for k, _, _ in assign], seen, out)
        if self.cfg.v > 1 and not quick and self.ctx.space.rank_splits:
            # several chunks a rank: splits that balance ranks, not stages alone, apart from the
            # others (their bounds are loose, planner.search prices a few of them besides)
            ranked = []
            for T in [tstar, *Ts[:3]]:
                add(rank_split(cost, self.L, self.stages_of, T), ranked)
            self.rank_balanced = [(lb, a) for a, lb in zip(ranked, self.evaluate_many(ranked)) if lb is not None]
            if S <= 16 and self.rank_balanced:
                lb, assign = min(self.rank_balanced, key=lambda x: x[0])
                self._polish(opts, lb, [k for k, _, _ in assign], seen, self.rank_balanced)
        return out

    def _polish(self, opts, lb, sz, seen, out):
        """Move one block between neighbouring stages while that lowers the LB, each move in turn
        from the split just made (first improvement, passes until none improves); the splits
        found go to `out`. The moves still to try from a split are evaluated together."""
        moves = list(itertools.product(range(self.S - 1), (1, -1)))
        improved = True
        while improved:
            improved, i = False, 0
            while i < len(moves):
                batch = []  # (move, split) of the moves from i on, not seen and with options
                for j in range(i, len(moves)):
                    s, d = moves[j]
                    new = list(sz)
                    new[s] -= d
                    new[s + 1] += d
                    if tuple(new) not in seen and all(k in opts[x] for x, k in enumerate(new)):
                        batch.append((j, new))
                cands = [self._assign(opts, new) for _, new in batch]
                i = len(moves)
                for (j, new), cand, nlb in zip(batch, cands, self.evaluate_many(cands)):
                    seen.add(tuple(new))
                    if nlb is not None and nlb < lb:
                        lb, sz, improved, i = nlb, new, True, j + 1
                        out.append((nlb, cand))
                        break

    @staticmethod
    def _assign(opts, sizes, zero=None):
        """Each stage with its cheapest option (by c) that fits (and has ZeRO level `zero`)."""
        out = []
        for s, k in enumerate(sizes):
            mn, ok = opts[s][k]
            if zero is not None:
                ok = ok[mn["zero"][ok] == zero]
                if not len(ok):
                    return None
            out.append((k, mn, int(ok[0])))
        return out

    def to_plan(self, assign, build) -> Plan:
        stages, start = [], 0
        for s, (k, mn, i) in enumerate(assign):
            emb, head = self.flags(s)
            nn, ns, nf = (int(x) for x in mn["cb"][mn["combo"][i]])
            rec = (["none"] if emb else []) + ["full"] * nf + ["selective"] * ns + ["none"] * nn + (["none"] if head else [])
            stages.append(Stage(layers=[start, start + len(rec)], zero=int(mn["zero"][i]), recompute=rec,
                                sequence_parallel=self.cfg.sp))
            start += len(rec)
        return build(self.cfg, stages)


def backward_s(assign) -> float:
    """An assignment's stages' backwards, as their menus bound them (planner.menus)."""
    return sum(float(mn["b"][i]) for _, mn, i in assign)


def recomputes_more(assign, other) -> bool:
    """Whether `assign` has the stages, block counts and ZeRO levels of `other` and recomputes at
    least as much in every block: planner.partition.Inner.to_plan sets a stage's modes full, then
    selective, then none, so at least as many full blocks, and as many full or selective ones, is
    a mode at least as costly at every position; every time the estimate adds grows with them, so
    its step is no shorter."""
    if len(assign) != len(other):
        return False
    for (k, mn, i), (k2, mn2, j) in zip(assign, other):
        if k != k2 or int(mn["zero"][i]) != int(mn2["zero"][j]):
            return False
        nn, ns, nf = mn["cb"][mn["combo"][i]]
        nn2, ns2, nf2 = mn2["cb"][mn2["combo"][j]]
        if nf < nf2 or nf + ns < nf2 + ns2:
            return False
    return True
