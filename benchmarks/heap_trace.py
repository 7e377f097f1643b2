"""Where a CPU run's peak memory goes: runtime.train's memory-measuring step with the C heap read
after every operation, on every rank, by the schedule's phase (`F2`: micro-batch 2's forward on
this rank's stage, `after-F2` until the next phase: its send, the next receive).

    python benchmarks/heap_trace.py PLAN.json [--steps 3] [--at OP] [--around 12] [--keep DIR]

Prints, per rank, each phase's lowest, highest and last heap above the step's start (MiB), and the
operations around the rank's peak (with --at OP, around operation OP instead, and the tensor
storages operations made in the step that are alive there: which operation made each, when and
in which phase).
The peak run.json reports adds the tensors alive at the step's start (parameters, optimizer
state, held receive buffers) to the highest reading here. Without --at the trace's own
bookkeeping allocates nothing the readings see (its rows are allocated before the step starts),
so its peak is the untraced run's (18.96 MiB on the tiny model's pp 2 1F1B plan of 4
micro-batches of 4 x 64 tokens, either way); with --at, the readings up to OP include its record of
each storage (some hundred bytes each). Session 38 found the MLP gate's backward with it
(docs/HISTORY.md). Needs glibc (mallinfo2); runs the plan's world size in gloo processes here.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import weakref
from pathlib import Path

ROWS = 400_000  # operations one step may run


def install(out_dir: str, at: int) -> None:
    """In a rank: make runtime.train's memory counter this tracer, and mark the schedule's phases."""
    import torch
    import torch.utils._pytree as pytree
    from torch.distributed.pipelining.stage import _PipelineStageBase

    import runtime.metrics as rm
    phase = ["-"]

    class Traced(rm.HeapPeak):
        def __init__(self, read):
            super().__init__(read)
            self.rows, self.seq, self.live, self.snapshot = [None] * ROWS, 0, {}, None
            phase[0] = "start"  # not the last step's last phase

        def _made(self, func, out, args, kwargs):  # storages this operation made, where --at asks
            def ptr(t):  # None for a tensor without a plain storage (a collective's pending result)
                try:
                    return t.untyped_storage().data_ptr()
                except RuntimeError:
                    return None
            seen = {ptr(a) for a in pytree.tree_leaves((args, kwargs))
                    if isinstance(a, torch.Tensor)}  # a view of an input makes no storage
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and (key := ptr(t)) is not None:
                    st = t.untyped_storage()
                    if st.nbytes() and key not in seen and key not in self.live:
                        self.live[key] = (st.nbytes(), str(func), self.seq, phase[0])
                        weakref.finalize(st, self.live.pop, key, None)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.seq += 1
            if at and self.seq <= at:
                self._made(func, out, args, kwargs or {})
            h = self.read()
            self.peak = max(self.peak, h)
            if self.seq < ROWS:
                self.rows[self.seq] = (func, h - self.start, phase[0])
            if self.seq == at:
                self.snapshot = sorted(self.live.values(), key=lambda x: x[2])
            return out

        def __exit__(self, *exc):
            done = super().__exit__(*exc)
            rows = [(i, str(r[0]), r[1], r[2]) for i, r in enumerate(self.rows[:self.seq + 1]) if r]
            path = Path(out_dir) / f"rank{os.environ.get('RANK', '0')}.json"
            path.write_text(json.dumps(dict(rows=rows, live=self.snapshot)))
            return done

    def marked(name, tag):
        inner = getattr(_PipelineStageBase, name)

        def run(self, chunk, *a, **k):
            phase[0] = f"{tag}{chunk}"
            try:
                return inner(self, chunk, *a, **k)
            finally:
                phase[0] = f"after-{tag}{chunk}"
        setattr(_PipelineStageBase, name, run)

    marked("forward_one_chunk", "F")
    marked("backward_one_chunk", "B")
    rm.cpu_counter = lambda: (Traced(rm.HEAP_READER), "C heap, traced (benchmarks/heap_trace.py)")


def report(path: Path, at: int, around: int) -> None:
    data = json.loads(path.read_text())
    rows, mib = data["rows"], 2 ** 20
    print(f"== {path.stem}: {len(rows)} operations; heap above the step's start, MiB")
    spans = []
    for i, name, heap, ph in rows:
        if not spans or spans[-1][0] != ph:
            spans.append([ph, i, i, heap, heap, heap])
        s = spans[-1]
        s[2], s[3], s[4], s[5] = i, min(s[3], heap), max(s[4], heap), heap
    for ph, a, b, lo, hi, end in spans:
        print(f"  {ph:10s} ops {a:6d}-{b:<6d} low {lo / mib:8.3f}  high {hi / mib:8.3f}  last {end / mib:8.3f}")
    peak = max(rows, key=lambda r: r[2])
    centre = at or peak[0]
    print(f"  peak {peak[2] / mib:.3f} MiB at op {peak[0]} ({peak[1]}, {peak[3]}); ops around {centre}:")
    prev = None
    for i, name, heap, ph in rows:
        if abs(i - centre) <= around:
            step = f"{(heap - prev) / 1024:+9.1f} KiB" if prev is not None else ""
            print(f"    {i:6d} {name[:44]:44s} {heap / mib:8.3f} {step} {ph}")
        prev = heap
    if data["live"]:
        total = sum(n for n, *_ in data["live"])
        print(f"  storages made in the step alive at op {at}: {len(data['live'])}, {total / mib:.3f} MiB")
        for n, name, seq, ph in data["live"]:
            if n >= 1024:
                print(f"    op {seq:6d} {name[:44]:44s} {n / 1024:9.1f} KiB {ph}")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("plan")
    ap.add_argument("--steps", type=int, default=3, help="runtime.train's steps (the third measures memory)")
    ap.add_argument("--at", type=int, default=0, help="an operation to show the live storages at")
    ap.add_argument("--around", type=int, default=12, help="operations shown either side")
    ap.add_argument("--keep", default=None, help="a directory for the per-rank traces (else a temporary one)")
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)  # in each rank (torchrun)
    ap.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rank:
        install(args.dir, args.at)
        from runtime.train import main as train
        return train(["--plan", args.plan, "--steps", str(args.steps), "--out", str(Path(args.dir) / "run.json")])
    from planner.plan import Plan
    world = Plan.read(args.plan).mesh.world_size
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.keep or tmp)
        out.mkdir(parents=True, exist_ok=True)
        from runtime.launch import run_local
        code = run_local(world, [__file__, "--rank", args.plan, "--steps", str(args.steps), "--at", str(args.at),
                                 "--dir", str(out)])
        if code:
            return code
        peaks = json.loads((out / "run.json").read_text())["peak_memory_bytes_per_rank"]
        print(f"run.json peak per rank, MiB: {', '.join(f'{p / 2 ** 20:.2f}' for p in peaks)}")
        for r in range(world):
            report(out / f"rank{r}.json", args.at, args.around)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
