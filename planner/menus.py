"""Stage option menus of one configuration (mixed into planner.stages.StageCosts).

A stage's menu lists its options, a ZeRO level and a recompute combination (how many of its k
blocks run with no, selective or full recomputation), as arrays over the options: forward f,
backward b, gradient sync, optimizer, ZeRO-1/2 gather, its per-micro-batch cost c, and its memory
parts (model state and buffers, activations per micro-batch in flight, replay, transients, what
is held from I to W under a split backward; its gradients and the most its first backward holds,
planner.memory.first_backward_bytes). Options dominated within their ZeRO level (no faster
backward for no fewer activations, same replay; where a rank peaks in its first backward, also the
same largest recompute mode) are dropped.

`menus` builds the menus of several block counts of one stage kind (with or without the
embedding and the head) together: the options of every k are rows of one set of arrays, so that
the search pays numpy's per-call cost once per stage kind rather than once per block count.
"""
from __future__ import annotations

import numpy as np

from planner.comm import exposed_beside, gather_beside_forward, plays_last_backward, reduce_beside_backward
from planner.layers import tied_head
from planner.fsdp_memory import forward_loss_bytes, fsdp_extra_parts, fsdp_groups, grads_sharded
from planner.memory import (accumulation_bytes, document_mask_bytes, first_backward_bytes, held_i_to_w_bytes,
                            tied_matrix_grad_bytes)
from planner.model import RECOMPUTE_MODES
from planner.pareto import pareto, top_mode

# one value per (k, ZeRO level); "transient" is the backward's (FSDP2's buffers and a new accumulated
# gradient), "end" a stage holding a tied embedding and head at the end of its backward, where the
# matrix's two gradients meet (planner.memory.tied_matrix_grad_bytes), "fsdp" what FSDP2 holds
# beside the loss (planner.fsdp_memory.forward_loss_bytes) and "logits" the loss's transient (the
# head's forward: planner.memory)
SCALARS = ("f", "sync", "opt", "gather", "fixed", "zero", "transient", "end", "fsdp", "logits")


class Menus:
    """Needs StageCosts' cfg, ctx, lc, split, zeros, dp_shape, ag/ar/rs (setup), blocks and _per_param."""

    def menu(self, k, emb, head):
        """The menu of a stage with k blocks (+ embedding / head)."""
        return self.menus((k,), emb, head)[k]

    def _menu_key(self, k, emb, head):
        """What a menu depends on: the data-parallel group by its shape, not by the mesh order that made it."""
        cfg, ctx = self.cfg, self.ctx
        return (cfg.tp, cfg.micro_batch, cfg.cp, cfg.sp, cfg.micro_batches > 1, cfg.micro_batches == 1, self.dp_shape,
                self.rep_shape, cfg.ep, self.experts and self.experts[3], id(self.lc),
                self.zeros, self.modes, ctx.space.recompute_granularity, k, emb, head, self.split, self.fb)

    def menus(self, ks, emb, head):
        """{k: menu} for the block counts `ks`, from this configuration's or the search's cache, the
        missing ones built together."""
        local = self.__dict__.setdefault("_local_menus", {})
        out, todo = {}, []
        for k in ks:
            mn = local.get((k, emb, head))
            if mn is None:
                mn = self.ctx._menus.get(self._menu_key(k, emb, head))
                if mn is not None:
                    local[(k, emb, head)] = mn
            if mn is None:
                todo.append(k)
            else:
                out[k] = mn
        if todo:
            for k, (mn, nbytes) in self._build_menus(todo, emb, head).items():
                self.ctx._menus.put(self._menu_key(k, emb, head), mn, nbytes)
                local[(k, emb, head)] = out[k] = mn
        return out

    def _build_menus(self, ks, emb, head):
        """{k: (menu, its bytes)} for the block counts ks (distinct)."""
        ctx, lc, cfg = self.ctx, self.lc, self.cfg
        split, model = self.split, ctx.model
        ends = ([lc["emb"]] if emb else []) + ([lc["head"]] if head else [])
        if emb and head and model.tie_embeddings:
            ends[-1] = tied_head(model, ends[-1], cfg.tp)
        blk = [lc["blk"][r] for r in RECOMPUTE_MODES]
        e_sum = lambda a: sum(getattr(x, a) for x in ends)  # noqa: E731
        mbs = cfg.micro_batches

        # every k's recompute combinations as rows of one set of arrays
        parts = [self.blocks(k) for k in ks]
        sizes = np.array([len(p[0]) for p in parts])
        start = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        kid = np.repeat(np.arange(len(ks)), sizes)  # each row's position in ks
        karr = np.array(ks, dtype=float)
        comp_b = np.concatenate([p[1] for p in parts]) + e_sum("bwd_compute_s")
        comp_f = np.concatenate([p[6] for p in parts]) + e_sum("fwd_compute_s")
        tp_f = np.concatenate([p[7] for p in parts]) + e_sum("fwd_tp_s")
        comp_w = np.concatenate([p[8] for p in parts]) + e_sum("bwd_weight_s")
        tp_b = np.concatenate([p[2] for p in parts]) + e_sum("bwd_tp_s")
        # the stage's output, which the runtime's pipeline keeps from each forward to its backward
        # (planner.memory.stage_output_bytes): every stage's but the last's; none where the
        # framework frees it once sent (pipeline.sent_outputs "freed", Megatron-LM's)
        output = self._message() if (self.S > 1 and not head and ctx.sent_kept) else 0.0
        if ctx.train.document_mask:  # and its mask, on a stage with blocks (planner.memory.stage_mask_bytes)
            output = output + (karr[kid] > 0) * document_mask_bytes(ctx.train, cfg.rank_micro_batch)
        act = np.concatenate([p[3] for p in parts]) + e_sum("activation_bytes") + output
        replay = np.concatenate([p[4] for p in parts])
        plain = np.concatenate([p[5] + s0 for p, s0 in zip(parts, start)])
        base = comp_b + tp_b
        cb_min = np.minimum.reduceat(comp_b, start)
        # the largest activations of a block among the modes a combination uses (first_backward_bytes)
        if self.fb:
            cb_all = np.concatenate([p[0] for p in parts])
            mode_act = np.array([x.activation_bytes for x in blk])
            top = np.max(np.where(cb_all > 0, mode_act[None, :], 0.0), axis=1)
        # held from each I to its W under a split backward (planner.memory.held_i_to_w_bytes): every
        # layer's weight-gradient inputs, and each fully recomputed block's replay
        held_iw = np.zeros(len(kid))
        if split:
            tokens = cfg.rank_micro_batch * ctx.train.seq_len
            held = lambda j: held_i_to_w_bytes(model, j, cfg.tp, tokens, ctx.e, 0.0, "none", cfg.sp)  # noqa: E731
            cb2 = np.concatenate([p[0][:, 2] for p in parts])
            held_iw += karr[kid] * held(1) + emb * held(0) + head * held(self.L + 1) + cb2 * blk[2].replay_bytes

        nz, nk = len(self.zeros), len(ks)
        sc, shift, beside_k, copy_bk, gather_f, w_sync, beside_sync = self._menu_scalars(ks, emb, head, ends, cb_min)
        steal = self.ctx.steal  # what runs beside a compute slows it (planner.comm.exposed_beside)
        more = self._by_mode(comp_f + tp_f, comp_w)  # what dominance also compares (blocks)

        # per ZeRO level: the options kept and their backward
        rows, tags, bs = [], [], []
        for zi in range(nz):
            exposed = ~np.isnan(beside_k[zi])
            b = base + shift[zi][kid]
            if not np.isnan(w_sync[zi]).all():  # split: what W's weight gradients leave of the reduce-scatter
                b += exposed_beside(w_sync[zi][kid], comp_w, steal)
            keep = plain[~exposed[kid[plain]]]
            if exposed.any():  # those k re-sorted by their shifted backward, per k and replay class
                on = np.flatnonzero(exposed[kid])
                bx = base[on] + exposed_beside(beside_k[zi][kid[on]], comp_b[on], steal) + copy_bk[zi][kid[on]]
                b[on] = bx
                rid = np.unique(replay[on], return_inverse=True)[1]
                if self.fb:  # and by the largest mode, as blocks() classes them
                    rid = rid * 3 + top_mode(cb_all[on], mode_act)
                cls = kid[on] * (rid.max() + 1) + rid
                keep = np.sort(np.concatenate((keep, on[pareto(bx, act[on], cls, [x[on] for x in more])])))
            rows.append(keep)
            tags.append(np.full(len(keep), zi))
            bs.append(b)
        rows, tags = np.concatenate(rows), np.concatenate(tags)
        order = np.lexsort((tags, kid[rows]))  # by k, then ZeRO level, rows in order
        rows, tags = rows[order], tags[order]
        kr = kid[rows]
        b = np.stack(bs)[tags, rows]
        # the scalars of each (k, ZeRO level), repeated over its rows (contiguous, in that order)
        runs = np.bincount(kr * nz + tags, minlength=nk * nz)
        scal = np.repeat(sc.transpose(0, 2, 1).reshape(len(SCALARS), nk * nz), runs, axis=1)
        # the forward: its compute and TP time (by mode where a model profile measured them apart),
        # the ZeRO-3 gather beyond the compute, and FSDP2's copies (the scalar "f" so far)
        ag = np.repeat(gather_f.T.reshape(nk * nz), runs)
        scal[0] += comp_f[rows] + tp_f[rows] + exposed_beside(ag, comp_f[rows], steal)
        dlast = np.zeros(len(rows))
        if beside_sync is not None:  # the reduction beside the last backward: what it cannot hide
            two, back0, whole, back_last, gathers, last = (np.repeat(x.T.reshape(nk * nz), runs) if np.ndim(x) == 2
                                                           else x for x in beside_sync)
            # a last backward that plays ZeRO 2/3's communication with the parts
            # (planner.schedule.beside_backward) lasts at least its compute, copies and steal x its
            # gathers (b's shift at one micro-batch: `last`), but places its parts as one of its
            # compute and copies alone would, only later: bb. Else both are b.
            played = ~np.isnan(last)
            b_last = np.where(played, base[rows] + last, b)
            bb = np.where(played, base[rows] + np.repeat(copy_bk.T.reshape(nk * nz), runs), b)
            share = bb / np.maximum(base[rows], 1e-300)  # of the backward, a second of its compute
            every = whole
            rest = bb - share * back_last[kr]  # the backward's compute from the first part's gradients on
            # and the parts before the last slow that compute while they run beside it (at least
            # as much of them as it lasts: planner.schedule.beside_backward)
            after = np.maximum.reduce([scal[1] + steal * np.minimum(every - scal[1], rest),
                                       two - share * back0[kr], every - rest])
            # beyond b: the last part at least; and the gathers and parts run one after another
            scal[1] = np.maximum.reduce([b_last + scal[1], after + bb, every + gathers]) - b
            # where b holds an earlier micro-batch's reduce-scatters beside it, the last backward
            # itself may end sooner (its parts run on past it): what a chain through it loses
            dlast = np.minimum(0.0, b_last - b)
        c = mbs * (scal[0] + b) + scal[1] + scal[2] + scal[3]
        cols = dict(zip(SCALARS, scal))
        cols.update(b=b, act=act[rows], replay=replay[rows], combo=rows - start[kr], held_iw=held_iw[rows], c=c,
                    dlast=dlast)
        # gradients (a rank of v > 1 chunks has a chunk's only from its first backward on), and the
        # most a first backward holds of one micro-batch (planner.memory): read only where a rank
        # of one stage peaks there
        g = np.array([self._state(z)[1] for z in self.zeros])[tags]
        cols["grads"] = (karr[kr] * blk[0].params + sum(x.params for x in ends)) * g
        if self.experts:  # the experts' share at their own shard count
            gx = np.array([self._state(z, experts=True)[1] for z in self.zeros])[tags]
            cols["grads"] += karr[kr] * blk[0].expert_params * (gx - g)
        cols["first"] = np.zeros(len(rows))
        if self.fb:
            cols["first"] = first_backward_bytes(karr[kr], top[rows], blk[0].params * g,
                                                 [(x.activation_bytes, x.params * g) for x in ends]) + (
                                                     output[rows] if np.ndim(output) else output)
        bounds = np.searchsorted(kr, np.arange(nk + 1))
        # each k's options by c (stable), and their memory parts in that order (planner.partition.options)
        by_k = [np.argsort(c[i:j], kind="stable") for i, j in zip(bounds[:-1], bounds[1:])]
        by_c = np.concatenate([o + i for o, i in zip(by_k, bounds)])
        # what an option holds beside its activations, with the activation gradients (options' extra):
        # the backward's replay and transients, or the loss's forward where that holds more
        mem = (cols["fixed"] + np.maximum(cols["replay"] + cols["transient"],
                                          cols["logits"] + cols["fsdp"] - self.act_grad))[by_c]
        act_c = cols["act"][by_c]
        grads_c, first_c = cols["grads"][by_c], (cols["first"][by_c] if self.fb else cols["first"])
        # each option's row as planner.stages.StageCosts.evaluate reads it (its column names)
        rows_all = np.stack((cols["f"], cols["f"] + cols["b"], cols["opt"] + cols["gather"], cols["sync"], cols["fixed"],
                             cols["act"], cols["held_iw"], cols["replay"] + cols["transient"], cols["end"],
                             cols["fsdp"], cols["logits"], cols["grads"], cols["first"], cols["dlast"]), axis=1)
        row_bytes = sum(col.itemsize for col in cols.values()) + mem.itemsize + 3 * act_c.itemsize + rows_all[0].nbytes
        out = {}
        for j, k in enumerate(ks):
            sl = slice(bounds[j], bounds[j + 1])
            mn = Menu(cols, sl, cb=parts[j][0], rows=rows_all[sl])
            mn["order"], mn["mem_sorted"] = by_k[j], (mem[sl], act_c[sl])
            mn["first_sorted"] = (grads_c[sl], first_c[sl])
            out[k] = (mn, row_bytes * (sl.stop - sl.start))
        return out

    def _menu_scalars(self, ks, emb, head, ends, cb_min):
        """Per (ZeRO level, k), arrays (levels, len(ks)): the SCALARS (sc, their names first; "f" only
        FSDP2's forward copies, the rest of the forward depends on the option), the shift of every
        option's backward, what runs beside the backward where it is exposed beside some options'
        (NaN elsewhere: those options re-sort), FSDP2's backward copies, the ZeRO-3 forward's
        gather, and under a split backward the reduce-scatter W's weight gradients run beside (NaN
        elsewhere). Where the gradients' reduction runs beside the stage's last backward
        (planner.comm.reduce_beside_backward; else None last) the scalar "sync" is its last part,
        the stage's first layer's, which waits for that backward's end, and last come (the last two
        parts, the backward of the layer before the last part at most, all the parts, the backward of
        the first part's layer at least, ZeRO 3's backward gathers where the stage's last backward
        plays them on the parts' communicator, else 0, and where that backward plays ZeRO 2/3's
        communication (planner.cost) its own bound's shift beyond its compute, else NaN): the parts
        run one after another, each once the compute's share of the backward up to its layer is
        done, so the step ends at least that much after that backward's end, what an option's
        backward cannot hide; with the gathers, all of them and the parts after the backward's
        start (planner.comm.sync_parts, planner.schedule; _build_menus)."""
        ctx, lc, cfg = self.ctx, self.lc, self.cfg
        split, model = self.split, ctx.model
        blk = [lc["blk"][r] for r in RECOMPUTE_MODES]
        root = sum(x.params for x in ends)  # the stage's parameters beside its blocks
        groups = fsdp_groups(model.tie_embeddings, ends[0].params if emb else None, ends[-1].params if head else None)
        dp, e, mbs = cfg.shards, ctx.e, cfg.micro_batches
        tied = emb and head and model.tie_embeddings
        if tied:
            tied_bytes, tied_end = tied_matrix_grad_bytes(model, cfg.tp, ctx.gb, cfg.micro_batches)
        nz, nk = len(self.zeros), len(ks)
        Ps = [k * blk[0].params + root for k in ks]
        P = np.array(Ps, dtype=float)
        # of P, the experts expert parallelism spreads: sharded, reduced and gathered over their
        # own group (planner.cost; StageCosts.experts), the rest over the shard group
        X = np.array([k * blk[0].expert_params for k in ks], dtype=float)
        # one of each kind of layer the stage holds
        accum = np.array([accumulation_bytes(model, [1] * (k > 0) + [0] * emb + [model.layers + 1] * head,
                                             cfg.tp, dp, mbs, ctx.gb) for k in ks])
        def times(shape, fns, xs):  # (all-gather, all-reduce, reduce-scatter) of each x parameters
            for x in xs:  # the same for every micro-batch size and sequence-parallel setting
                if (shape, x) not in ctx._coll_times:
                    ag, ar, rs = fns
                    ctx._coll_times[(shape, x)] = ((ag(x * e), ar(x * ctx.gb), rs(x * ctx.gb)) if dp > 1 and x
                                                   else (0.0, 0.0, 0.0))
            return np.array([ctx._coll_times[(shape, x)] for x in xs]).T
        gathered, all_reduced, scattered = times(self.dp_shape, (self.ag, self.ar, self.rs), list(P - X))
        if self.experts:
            gathered, all_reduced, scattered = (a + b for a, b in zip(
                (gathered, all_reduced, scattered), times(self.experts[3], self.experts[:3], list(X))))
        # the backward's gathers: not a head's, gathered from its forward to its backward (planner.cost)
        gathered_b = gathered
        if head:  # the head has no experts
            fns = (self.ag, self.ar, self.rs)
            dense = [times(self.dp_shape, fns, list(P - X - h))[0] for h in (0, ends[-1].params)]
            gathered_b = gathered - dense[0] + dense[1]
        # HSDP: each stage's reduced shard all-reduced across the replicas once a step (planner.cost)
        replicas = (np.array([self.rep_ar((x + xx * (cfg.ep - 1)) * ctx.gb / dp) for x, xx in zip(Ps, X)])
                    if self.rep_shape else 0.0)
        # ZeRO 1/2's gather once a step, in the next first forward beside its compute (planner.cost)
        fwd = np.array([k * blk[0].fwd_compute_s for k in ks]) + sum(x.fwd_compute_s for x in ends)
        in_forward = gather_beside_forward(ctx.train, ctx.cluster)
        gathered_step = exposed_beside(gathered, fwd, ctx.steal) if in_forward else gathered
        beside_sync = None
        if reduce_beside_backward(ctx.train, ctx.cluster) and dp > 1:  # each layer's, as planner.comm.sync_parts
            layers = [blk[0], *ends]  # a block, then the stage's embedding and head where it has them
            _, by_ar, by_rs = times(self.dp_shape, (self.ag, self.ar, self.rs),
                                    [x.params - x.expert_params for x in layers])
            if self.experts:
                _, x_ar, x_rs = times(self.experts[3], self.experts[:3], [x.expert_params for x in layers])
                by_ar, by_rs = by_ar + x_ar, by_rs + x_rs
            # the stage's first two layers (the backward's last two; indices into layers, -1 none),
            # the backward of its first at most and of its last (the head, else a block) at least:
            # the compute's share of the backward places the parts
            back = lambda x: x.bwd_compute_s + x.bwd_tp_s  # noqa: E731 (with CP and EP: planner.search)
            hi, lo = max(back(x) for x in blk), min(back(x) for x in blk)
            kf = np.array(ks, dtype=float)
            order = [[1] * emb + [0] * min(k, 2) + [len(layers) - 1] * head for k in ks]
            l0 = np.array([o[0] for o in order])
            l1 = np.array([o[1] if len(o) > 1 else -1 for o in order])
            back0 = np.array([back(ends[0]) if emb else hi if k else back(ends[-1]) for k in ks])
            back_last = np.array([back(ends[-1]) if head else lo if k else back(ends[0]) for k in ks])
            beside_sync = (np.zeros((nz, nk)), back0, np.zeros((nz, nk)), back_last, np.zeros((nz, nk)),
                           np.full((nz, nk), np.nan))
        sc = np.zeros((len(SCALARS), nz, nk))
        shift = np.zeros((nz, nk))
        beside_k = np.full((nz, nk), np.nan)  # exposed beside the backward: the options reorder
        copy_bk = np.zeros((nz, nk))
        gather_f = np.zeros((nz, nk))
        w_sync = np.full((nz, nk), np.nan)
        # what runs in a forward or backward, collectives included, counts as work where measured
        # layers are (Ctx.work: processes sharing compute, as the estimate plays them); the step's
        # gradient sync, optimizer and gathers do not
        w, defer = ctx.work, ctx.train.defer_grad_sync
        for zi, z in enumerate(self.zeros):
            state, copies = self._per_param(z)
            ag, ag_b = (gathered, gathered_b) if z == 3 else (np.zeros(nk), np.zeros(nk))
            reduced = all_reduced if z == 0 else scattered
            sync = reduced + replicas
            if beside_sync is not None:  # beside the last backward: the first layer's part at least
                red = by_ar if z == 0 else by_rs
                sync = red[l0] + replicas
                beside_sync[0][zi] = sync + np.where(l1 >= 0, red[l1], 0.0)  # the last two
                beside_sync[2][zi] = kf * red[0] + red[1:].sum() + replicas  # all
            # ZeRO-2/3 reduce-scatter each micro-batch's gradients beside its backward
            beside = w * (ag_b + reduced if (dp > 1 and mbs > 1 and grads_sharded(z, mbs, defer)) else ag_b)
            # its last backward plays its gathers with the reduction's parts (planner.cost): it lasts
            # at least its work and steal x the gathers (the compute idles or slows while they run)
            played = plays_last_backward(ctx.train, ctx.cluster, z, dp, mbs, split)
            # FSDP2's buffer copies on the compute stream (planner.precision.fsdp_copy_bytes)
            copy_f, copy_b, copy_s = (x * P for x in copies)
            copy_f, copy_b = w * copy_f, w * copy_b
            if played:
                beside_sync[4][zi] = w * ag_b
                beside_sync[5][zi] = copy_b + ctx.steal * w * ag_b
            gather_f[zi] = w * ag
            copy_bk[zi] = copy_b
            if split and z >= 2 and dp > 1:  # planner.cost: I and W gather, W then reduce-scatters
                shift[zi] = 2 * w * ag + copy_b
                w_sync[zi] = w * reduced
            else:  # the same shift for every option (the compute it slows), or where exposed beside
                # some options' backward (planner.comm.exposed_beside)
                exposed = ((1 - ctx.steal) * beside > cb_min) & (not split) & (not (played and mbs == 1))
                shift[zi] = copy_b + np.where(exposed, 0.0, ctx.steal * beside)
                beside_k[zi] = np.where(exposed, beside, np.nan)
            opt = (P + X * (cfg.ep - 1)) / (dp if z >= 1 else 1) * ctx.osb / ctx.bw
            gather = (gathered_step if z in (1, 2) else 0.0) + copy_s
            # all FSDP2's buffers depend on, and k
            extra = (z, dp, mbs > 1, split, cfg.v > 1, cfg.pp == 1, blk[0].params, groups, defer)
            if len(ctx._fsdp_extra.get(extra, ())) <= max(ks):  # every k up to the largest, at once
                ctx._fsdp_extra[extra] = np.array([
                    fsdp_extra_parts(z, dp, mbs, [blk[0].params] * k, groups[0], ctx.pb, ctx.gb, ctx.spb, split,
                                     ctx.cluster.backend == "gloo", groups[1], head_held=cfg.v > 1,
                                     resharded=cfg.pp == 1 and mbs == 1, defer=defer)
                    for k in range(max(ks) + 1)])
            held_b, transient = ctx._fsdp_extra[extra][list(ks)].T
            fsdp = np.full(nk, forward_loss_bytes(z, dp, groups[1][1], ctx.pb, cfg.v > 1))  # beside the loss
            transient = transient + accum
            fixed = P * state + held_b
            if self.experts:
                fixed = fixed + X * (sum(self._state(z, experts=True)) - state)
            if z == 0 and dp > 1:  # replicate's gradients in the compute dtype beside the reduced ones
                fixed = fixed + P * ctx.pb
            end = np.zeros(nk)  # the end of the backward, where a tied matrix's two gradients meet
            if tied:
                end = fixed + self.act_grad + tied_end
                fixed = fixed + tied_bytes
            logits = np.full(nk, self.head_logits if head else 0.0)
            sc[:, zi] = (copy_f, sync, opt, gather, fixed, np.full(nk, z), transient, end, fsdp, logits)
        return sc, shift, beside_k, copy_bk, gather_f, w_sync, beside_sync


class Menu(dict):
    """A stage's menu: its columns, each sliced on first use from the arrays of all the block
    counts built together (a search builds tens of thousands and reads a few columns of each)."""

    def __init__(self, cols: dict, sl: slice, **items):
        super().__init__(**items)
        self._cols, self._sl = cols, sl

    def __missing__(self, name):
        col = self[name] = self._cols[name][self._sl]
        return col
