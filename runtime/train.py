"""torchrun entry: plan -> DeviceMesh -> model on meta -> parallelize -> materialize -> train -> run.json.

    torchrun --nproc-per-node N -m runtime.train --plan plan.json [--steps S] [--out run.json]

Bad input (an invalid plan, a world size other than the plan's, a plan predicted not to fit,
a mismatched checkpoint) ends every rank with one line on stderr and exit status 2, checked
before the process group starts wherever possible. `--plan` may name several plans of the same
world size; they are trained one after another in the same processes (the tests use this to pay
the start-up once), each writing OUT/<plan file stem>.json where OUT is then a directory.
"""
from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from planner.compare import busy_note, leak_note
from planner.model import ConfigError
from planner.plan import Plan, split_backward
from runtime import checkpoint as ckpt
from runtime.context_parallel import ContextParallel, apply_context_parallel
from runtime.data import local_rows, make_source, source_meta
from runtime.documents import attach_documents, end_of_text, set_micro, synthetic_note
from runtime.dropout import attach_dropout, dropout_step
from runtime.evaluate import Evaluator
from runtime.hf_weights import initial_weights
from runtime.loss import IGNORE, cross_entropy
from runtime.host_share import HostWatch
from runtime.launch import free_port
from runtime.metrics import MetricsLog, PeakMemory, environment, gather, held_bytes
from runtime.oneline import fail
from runtime.model import Transformer, init_weights
from runtime.moe import apply_expert_parallel, attach_routing
from runtime.optim import clip_grad_norm, lr_at, param_groups, reduce_partial_grads
from runtime.loss_scale import LossScale
from runtime.tied import TiedMatrix
from runtime.parallelize import apply_data_parallel, apply_recompute, apply_tp, build_mesh, retie
from runtime.pipeline import build_schedule, held_tensors, run_schedule
from runtime.trace import traced_step
from runtime.run_checks import check_out, check_plan, parse_args  # noqa: F401 (check_plan, parse_args: runtime.train's API)

BETAS = (0.9, 0.95)
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(plan: Plan, args, device: torch.device) -> str:
    return args.dtype or (plan.training.dtype if device.type == "cuda" else "fp32")


class Trainer:
    """The model chunks, optimizers and schedule of one plan on this rank."""

    def __init__(self, plan: Plan, args, device: torch.device):
        self.plan, self.args, self.device = plan, args, device
        m = plan.mesh
        self.mesh, self.dp_mesh = build_mesh(m, device.type)
        self.pp_rank = self.mesh["pp"].get_local_rank()
        self.dp_rank = m.coords(dist.get_rank())["dp"]  # of the batch: HSDP's replica x shard_size + shard
        self.tp_rank = self.mesh["tp"].get_local_rank()
        self.context = None  # context parallelism (runtime.context_parallel)
        if m.cp > 1:
            self.context = ContextParallel(self.mesh["cp"].get_group(), m.cp, m.coords(dist.get_rank())["cp"],
                                           plan.training.seq_len, device)
        self.stage_ids = plan.stages_of_rank(self.pp_rank)
        self.n_stages = len(plan.pipeline.stages)
        self.dtype = compute_dtype(plan, args, device)
        self.scaler = LossScale(self.dtype == "fp16", args.initial_loss_scale)  # fp16's (runtime.loss_scale)
        self.full_of = initial_weights(args, plan)  # --init-from (runtime.hf_weights), else None
        self.chunks = [self._build_chunk(sid) for sid in self.stage_ids]
        attach_dropout(self.chunks, plan, self.dp_rank, self.tp_rank, self.context, device)
        self.routing = attach_routing(self.chunks, plan, self.scaler, self.tp_rank, self.context, device)  # MoE
        self.eos = end_of_text(plan, args, source_meta(args.data))  # document masks' and eod_mask_loss's
        self.documents = attach_documents(self.chunks, self.eos if plan.training.document_mask else None,
                                          plan.training.reset_position_ids)
        t = plan.training
        # torch's fused AdamW (CUDA and CPU kernels): one pass, no temporaries (planner.precision.optimizer_step_bytes)
        self.optimizers = [torch.optim.AdamW(param_groups(c, t.weight_decay), lr=t.lr, betas=BETAS, fused=True)
                           for c in self.chunks]
        self.tied = TiedMatrix(plan, self.mesh["pp"].get_group(), self.chunks)  # a pipeline's tied embedding
        self.schedule = None
        if m.pp > 1:
            self.schedule = build_schedule(plan, self.chunks, self.stage_ids, self.mesh["pp"].get_group(), device,
                                           self.loss)

    def _build_chunk(self, sid: int) -> Transformer:
        st, cfg, m = self.plan.pipeline.stages[sid], self.plan.model, self.plan.mesh
        with torch.device("meta"):
            chunk = Transformer(cfg, st.start, st.end)
        experts = apply_expert_parallel(chunk, self.mesh, m)  # runtime.moe: their FSDP2 mesh, or None
        if m.tp > 1:
            apply_tp(chunk, self.mesh["tp"], st.sequence_parallel, self.plan.training.sp_saved_inputs == "shard")
        apply_recompute(chunk, {st.start + j: r for j, r in enumerate(st.recompute)}, split_backward(
            self.plan.pipeline.schedule, m.pp), self.plan.training.selective_recompute == "ops")
        apply_data_parallel(chunk, self.dp_mesh, st.zero, AUTOCAST_DTYPES.get(self.dtype), experts)
        chunk.to_empty(device=self.device)
        retie(chunk)  # to_empty gives plain tied parameters two copies
        init_weights(chunk, self.plan.training.seed, self.full_of)
        if self.context is not None:
            apply_context_parallel(chunk, self.context)
        kinds = {type(p).__name__ for p in chunk.parameters()}
        assert len(kinds) == 1, f"stage {sid} mixes parameter kinds {kinds}; AdamW's kernels need one kind"
        return chunk

    def _autocast(self):
        """bf16 compute on fp32 master weights: without data parallelism autocast casts the fp32
        parameters at each use; with it FSDP2 already gathers bf16 ones (apply_data_parallel's
        MixedPrecisionPolicy) and autocast keeps its float32 ops (norms, softmax, losses) in fp32.
        The autocast weight cache is off: with FSDP2's unsharded parameters it serves stale casts
        across micro-batches (losses drift from the single-process run's), so each use casts afresh."""
        if self.dtype == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=AUTOCAST_DTYPES[self.dtype], cache_enabled=False)

    def _set_grad_sync(self, last: bool):
        """Gradients reduce on the step's last micro-batch, except under ZeRO 2 and 3, which
        reduce-scatter every micro-batch's and accumulate them sharded (unless the plan defers their
        sync too, training.defer_grad_sync: unsharded until the last). ZeRO 1/2 keep the gathered
        parameters until the last one (FSDP2 would free them after each backward and gather them
        again for every micro-batch: the plan prices one gather per step); ZeRO 3 frees them."""
        from torch.distributed.fsdp import FSDPModule
        for c, sid in zip(self.chunks, self.stage_ids):
            if isinstance(c, FSDPModule):
                zero = self.plan.pipeline.stages[sid].zero
                c.set_requires_gradient_sync(last or (zero >= 2 and not self.plan.training.defer_grad_sync))
                c.set_requires_all_reduce(last)  # HSDP: the replicas all-reduce the accumulated shard once
                if zero in (1, 2):
                    c.set_reshard_after_backward(last)

    def step(self, batch: torch.Tensor, step: int) -> float:
        """Optimizer step `step` (0-based: its learning rate, runtime.optim.lr_at) on the global batch
        [global_batch, seq_len + 1]; returns its mean loss."""
        plan = self.plan
        inputs, targets = self.local_batch(batch)
        n_micro = plan.pipeline.micro_batches
        dropout_step(self.chunks, step)
        local_loss = torch.zeros((), dtype=torch.float64)
        with self._autocast():
            if self.schedule is not None:
                losses = run_schedule(self.schedule, self.stage_ids, self.n_stages, inputs, targets)
                if losses:
                    local_loss += sum(float(l.detach()) for l in losses) / n_micro / self.scaler.scale
            else:
                local_loss += self._accumulate(inputs.chunk(n_micro), targets.chunk(n_micro)) / self.scaler.scale
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t_opt, timing = time.perf_counter(), {}
        params = [p for c in self.chunks for p in c.parameters()]
        reduce_partial_grads(params, timing=timing)
        self.tied.sync(timing)
        self.grad_norm = clip_grad_norm(params, plan.training.grad_clip, self.mesh["pp"].get_group() if plan.mesh.pp > 1
                                        else None, self.device, timing, uncounted=self.tied.copy,
                                        inv_scale=1.0 / self.scaler.scale, ep=self.mesh["ep"] if plan.mesh.ep > 1 else None)
        self.lr = lr_at(plan.training, step)
        stepping = self.scaler.update(self.grad_norm)  # every rank alike: the norm is the world's
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["lr"] = self.lr
            if stepping:
                opt.step()
            opt.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        # gradient clipping and the optimizer step on this rank, less the collectives before it
        # (they wait for the other ranks' backwards; the planner prices them outside its step)
        self.optimizer_s = time.perf_counter() - t_opt - sum(timing.values())
        self.pipeline_wait_s = timing.get("pp_wait_s", 0.0)  # for the other pipeline ranks' backward
        self.routing.read()  # MoE: the step's routing figures
        return self.mean_loss(float(local_loss))

    def local_batch(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (inputs, targets) of a global batch, on its device: its data-parallel rank's
        rows, its CP rank's tokens."""
        inputs, targets = local_rows(batch, self.dp_rank, self.plan.mesh.dp)
        if self.context is not None:
            inputs, targets = self.context.local_tokens(inputs), self.context.local_tokens(targets)
        inputs, targets = inputs.to(self.device), targets.to(self.device)
        if self.documents is not None:  # their document masks (runtime.documents)
            self.documents.set_rows(inputs)
        # a micro-batch's summed loss over its share of the global batch's counted tokens (runtime.loss)
        counted = int((batch[:, :-1] != self.eos).sum()) if self.plan.training.eod_mask_loss else batch[:, 1:].numel()
        self.loss_tokens = max(1, counted) / (self.plan.pipeline.micro_batches * self.plan.mesh.grad_ranks)
        if self.plan.training.eod_mask_loss:
            targets = targets.masked_fill(inputs == self.eos, IGNORE)
        return inputs, targets

    def mean_loss(self, local: float) -> float:
        """The loss of a global batch, the same on every rank: the mean over data-parallel (and CP:
        equal token counts) ranks of the last stage's `local` loss."""
        owner = self.n_stages - 1 in self.stage_ids and self.tp_rank == 0
        total = torch.tensor([local if owner else 0.0], dtype=torch.float64, device=self.device)
        dist.all_reduce(total)
        return float(total) / self.plan.mesh.grad_ranks

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of a micro-batch from this rank's vocabulary slice of the logits."""
        group = self.mesh["tp"].get_group() if self.plan.mesh.tp > 1 else None
        return cross_entropy(logits, targets, group, self.tp_rank, self.plan.model.vocab, self.scaler.scale,
                             self.loss_tokens)

    def _accumulate(self, xs, ys) -> float:
        losses = []
        for i, (x, y) in enumerate(zip(xs, ys)):
            self._set_grad_sync(i == len(xs) - 1)
            set_micro(self.chunks[0], i)
            loss = self.loss(self.chunks[0](x), y) / len(xs)
            loss.backward()
            losses.append(loss.detach())
            # the name would keep this micro-batch's autograd graph (the nodes and saved-variable records the backward
            # leaves) alive through the next forward; on CPU device memory: 0.27 MiB on tiny's tp4 plan, 4% of its peak
            del loss
        # read once a step: reading each micro-batch's loss waited for its backward on a GPU, which then idled while
        # the host launched the next forward (1.1-1.3 ms a micro-batch, H200 runs of 2026-11-30, 4 x 2048 tokens)
        return float(torch.stack(losses).double().sum())


def train(plan: Plan, plan_path: str, args, device: torch.device, backend: str, host: HostWatch) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    t = plan.training
    trainer = Trainer(plan, args, device)
    plan_hash = plan.content_hash()
    if trainer.dtype != t.dtype and not args.dtype and rank == 0:
        print(f"note: the plan's training.dtype is {t.dtype}; on {device.type} the runtime computes in "
              f"{trainer.dtype} unless asked (--dtype)", flush=True)
    source = make_source(args.data, t.seq_len, t.seed, plan.model.vocab, args.data_dtype)
    if trainer.documents is not None and rank == 0 and (note := synthetic_note(source, trainer.documents.eos_id)):
        print(f"note: {note}", flush=True)
    if hasattr(source, "describe") and rank == 0:  # token files, read in epochs (runtime.data, runtime.blend)
        print(f"data: {source.describe(t.global_batch)}", flush=True)
    start_step = ckpt.resume(args, plan, trainer, rank)
    # three warm-up steps, not timed: the first allocates the optimizer state, the third measures the
    # peak memory (tracking every allocation slows it several-fold). Not the second: on CPU the C
    # heap the peak reads also grows once by what gloo and Python keep for good, and in a process
    # that trained other plans before, part of that came in this plan's second step (+0.45 MiB of
    # a 6.4 MiB peak, benchmarks/prediction_accuracy.py's w4-tp4-sp). With fewer steps the peak is
    # the last one's (the first's misses the optimizer state) and there is no clean time: say so.
    left = args.steps - start_step
    warmup, measure_at = min(3, left), start_step + min(2, max(left - 1, 0))
    if left < 4 and rank == 0:
        print(f"note: {left} step(s): the step times include a warm-up or the memory-measuring step"
              + ("; the peak memory is the first step's, before the optimizer state exists" if left < 2 else "")
              + ("; --trace traces no step (the last measures the memory)" if args.trace else "")
              + "; ask for 4 or more steps to compare", flush=True)
    peak = PeakMemory(device, trainer.chunks, trainer.optimizers, lambda: held_tensors(trainer.schedule))
    evaluator, saver = Evaluator(args, plan), ckpt.Saver(args, device.type)
    log = MetricsLog(args.metrics, resumed=start_step > 0)
    # cores busy with other work before the steps, and how many ranks computed at full speed at once
    # (the cluster profile's compute_slots, measured again; runtime.host_share.HostWatch)
    before, slots = host.before()
    losses, times, grad_norms, opt_times, waits, lrs, held, scales, trace = [], [], [], [], [], [], [], [], {}
    for step in range(start_step, args.steps):
        batch = source.batch(step, t.global_batch)
        ctx = peak.measure() if step == measure_at else contextlib.nullcontext()
        if args.trace and step == args.steps - 1 and step != measure_at:
            ctx = traced_step(device, args.trace, Path(plan_path).stem, rank, trace)
        dist.barrier()
        t0 = time.perf_counter()
        with ctx:
            loss = trainer.step(batch, step)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()
        times.append(time.perf_counter() - t0)
        held.append(held_bytes(device))
        opt_times.append(trainer.optimizer_s)
        waits.append(trainer.pipeline_wait_s)
        if not math.isfinite(loss):  # the same figure on every rank (all-reduced): they stop together
            raise ConfigError(f"step {step + 1}: the loss is {loss} (gradient norm {trainer.grad_norm:g}): training "
                              f"diverged; lower training.lr ({trainer.lr:g}) or training.grad_clip "
                              f"({plan.training.grad_clip:g}) in the plan (trident plan --lr / --grad-clip)")
        losses.append(loss)
        grad_norms.append(trainer.grad_norm)
        scales.append(trainer.scaler.scale)
        lrs.append(trainer.lr)
        if rank == 0:
            rate = f"  lr {trainer.lr:.3g}" if t.lr_scheduled else ""
            print(f"step {step + 1}/{args.steps}  loss {loss:.6f}{rate}  {times[-1] * 1000:.0f} ms", flush=True)
        log.write(step=step + 1, loss=loss, lr=trainer.lr, grad_norm=trainer.grad_norm if math.isfinite(trainer.grad_norm)
                  else None, step_time_s=times[-1], tokens_per_s=t.global_batch * t.seq_len / times[-1])
        if evaluator.due(step):  # after the step's time and memory: a validation loss (runtime.evaluate)
            loss = evaluator.run(trainer, step)
            if rank == 0:
                print(f"step {step + 1}/{args.steps}  validation loss {loss:.6f}", flush=True)
            log.write(step=step + 1, validation_loss=loss)
        if saver.due(step):
            saver.save(step + 1, trainer.chunks, trainer.optimizers, plan,
                       {"next_step": step + 1, "loss_scale": trainer.scaler.state()})
    saver.finish()  # an asynchronous save under way (--async-checkpoint)
    log.close()
    busy = max((x for x in (before, host.after()) if x is not None), default=None)
    note = busy_note(busy, len(os.sched_getaffinity(0)))
    if note and rank == 0:
        print(f"warning: {note}", file=sys.stderr, flush=True)
    # the traced step runs under the profiler, slower: it is left out of the step time
    timed = times[warmup:len(times) - bool(trace)] or times[warmup:] or times
    peaks = gather(peak.bytes)
    opt_by_rank = gather(opt_times)
    tokens = t.global_batch * t.seq_len
    return {
        "plan": str(plan_path), "plan_hash": plan_hash,
        "world_size": world,
        "mesh": {"pp": plan.mesh.pp, "dp": plan.mesh.dp, "cp": plan.mesh.cp, "tp": plan.mesh.tp, "order": plan.mesh.order,
                 "dp_replicate": plan.mesh.dp_replicate, "ep": plan.mesh.ep},
        "schedule": plan.pipeline.schedule, "optimizer": "adamw-fused",  # torch's fused AdamW kernel
        "dtype": trainer.dtype,
        "first_step": start_step, "init_from": trainer.full_of.record() if trainer.full_of else None,
        "steps": len(losses),
        "losses": losses,
        "grad_norms": [g if math.isfinite(g) else None for g in grad_norms],  # before clipping (null: fp16 skipped)
        **trainer.routing.record(),  # MoE: moe_balance (unscaled) and moe_load_factor (runtime.moe)
        # fp16: the loss scale after each step (runtime.loss_scale), halved where one was skipped
        "loss_scales": scales if trainer.scaler.enabled else None,
        "learning_rates": lrs,
        "step_times_s": times,
        # per step, the slowest rank's gradient clipping + optimizer step (part of step_times_s)
        "optimizer_times_s": [max(r[i] for r in opt_by_rank) for i in range(len(times))],
        # per rank, per step: its wait in the gradient norm's pipeline all-reduce (null without one)
        "pipeline_wait_times_s_per_rank": gather(waits) if plan.mesh.pp > 1 else None,
        # the index in step_times_s of the step traced under --trace (slower: compare leaves it out)
        "traced_step_index": len(times) - 1 if trace else None,
        "warmup_steps": warmup,
        "tokens_per_step": tokens,
        # epochs of the token file (a blend: of each file) read by the end of the run (null: synthetic data)
        "data_epochs": source.epochs(args.steps * t.global_batch) if hasattr(source, "epochs") else None,
        "tokens_per_s": tokens * len(timed) / sum(timed),
        "peak_memory_bytes": max((p for p in peaks if p is not None), default=None),
        "peak_memory_bytes_per_rank": peaks,
        "peak_memory_method": peak.method,
        # per rank, the bytes held after each step (runtime.metrics.held_bytes): compare notes growth
        # after the memory-measuring step (memory_step_index in losses), a leak
        "memory_held_after_step_bytes_per_rank": gather(held), "memory_step_index": measure_at - start_step,
        "environment": environment(backend, device),
        # CPU cores other work kept busy while this run's processes slept, before and after the steps
        "host_other_busy_cores": busy, "host_cores": len(os.sched_getaffinity(0)), "host_compute_slots": slots,
        **({"trace": gather(trace)} if trace else {}),
        **({"validation": evaluator.results} if evaluator.every else {}),  # [{step, loss}]
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        plans = [(check_plan(p, args, world), p) for p in args.plan]
        for flag in ("checkpoint_dir", "metrics"):
            if len(plans) > 1 and getattr(args, flag):
                raise ConfigError(f"--{flag.replace('_', '-')} works with one --plan at a time")
        check_out(args.out, len(plans))
    except ConfigError as exc:
        return fail(str(exc))
    if "RANK" not in os.environ:  # a one-process run without torchrun
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    from runtime.device import init
    try:
        backend, device = init(local_rank)
    except ConfigError as exc:
        return fail(str(exc))
    dist.init_process_group(backend, timeout=timedelta(minutes=10))
    try:
        host = HostWatch(device.type == "cpu", dist.get_world_size())
        for plan, path in plans:
            result = train(plan, path, args, device, backend, host)
            if dist.get_rank() == 0 and (note := leak_note(result)):  # as trident compare says it
                print(f"warning: {note}", file=sys.stderr, flush=True)
            if dist.get_rank() == 0 and args.out:
                out = Path(args.out) / f"{Path(path).stem}.json" if len(plans) > 1 else Path(args.out)
                try:  # a full disk after the run: one line, not a traceback
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.write_text(json.dumps(result, indent=2) + "\n")
                except OSError as exc:
                    raise ConfigError(f"--out: cannot write {out} ({exc.strerror or exc}); the record is lost") from None
        # free what the plans left (reference cycles) and meet before the process group goes: a rank destroying it
        # while rank 0 still wrote aborted at exit now and then on a loaded host (tests/sp_probe.py: how often)
        gc.collect()
        dist.barrier()
        return 0
    except ConfigError as exc:
        return fail(str(exc))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    code = main()
    # Leave without interpreter finalization: Gloo's worker threads can still hold work objects
    # whose teardown aborts the process (SIGABRT, "terminate called without an active exception",
    # about one run in twenty here; pytorch/pytorch#179291). Everything is written by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
