"""What a checkpoint every step costs a run on this machine, written at once or asynchronously
(runtime.train --async-checkpoint): the wall time of whole runs, each mode run in turn, in rounds.

    python benchmarks/async_checkpoint.py [--rounds 3] [--steps 6] [--world 2] [--keep DIR]

Each round trains the same plan (the `small` zoo model, data parallel over `--world` gloo
processes, ZeRO 1, sequences of 256) for `--steps` steps three times: without checkpoints, with a
synchronous checkpoint after every step, and with an asynchronous one. Printed: each mode's median
wall time over the rounds, the cost of one checkpoint beside the run without (the difference over
the number of saves), the median step time the runs' records measured (the training steps alone,
which an asynchronous save's writes in a background thread may slow), and the checkpoint's size.
Times on this shared 2-core host move by the minute: the modes alternate within each round.
"""
from __future__ import annotations

import argparse
import json
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from planner.build import build_plan  # noqa: E402
from planner.zoo import ZOO  # noqa: E402

MODES = {"none": [], "sync": ["--checkpoint-every", "1"], "async": ["--checkpoint-every", "1", "--async-checkpoint"]}


def launch(world: int, args: list) -> float:
    """Wall seconds of one runtime.train launch under torchrun."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-port", str(port),
           "-m", "runtime.train", *map(str, args)]
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    took = time.perf_counter() - t0
    if proc.returncode:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return took


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--keep", default=None, help="keep the plan, records and checkpoints here")
    args = ap.parse_args(argv)
    out = Path(args.keep or tempfile.mkdtemp(prefix="async-ckpt-"))
    out.mkdir(parents=True, exist_ok=True)
    plan = build_plan(ZOO["small"], cluster_name="cpu", device="cpu", nodes=1, devices_per_node=args.world,
                      global_batch=4 * args.world, micro_batch=2, seq_len=256, zero=1, dtype="fp32")
    path = out / "plan.json"
    plan.write(path)
    walls: dict = {m: [] for m in MODES}
    steps: dict = {m: [] for m in MODES}
    size = 0
    for r in range(args.rounds):
        for mode, extra in MODES.items():
            ckpt = out / f"ckpt-{mode}"
            shutil.rmtree(ckpt, ignore_errors=True)
            rec = out / f"{mode}-{r}.json"
            more = ["--checkpoint-dir", ckpt] if extra else []
            walls[mode].append(launch(args.world, ["--plan", path, "--steps", args.steps, "--out", rec, *more, *extra]))
            run = json.loads(rec.read_text())
            steps[mode].append(statistics.median(run["step_times_s"][run["warmup_steps"]:] or run["step_times_s"]))
            if extra:
                saved = sorted(ckpt.iterdir())
                assert [p.name for p in saved] == [f"step-{i}" for i in range(1, args.steps + 1)], saved
                size = sum(f.stat().st_size for f in saved[-1].rglob("*") if f.is_file())
            print(f"round {r + 1} {mode:5s}: {walls[mode][-1]:6.1f} s", flush=True)
    base = statistics.median(walls["none"])
    print(f"\nthe small model ({ZOO['small'].num_parameters() / 1e6:.1f} M parameters), dp {args.world} ZeRO 1, "
          f"{args.steps} steps; a checkpoint {size / 2**20:.0f} MiB; medians of {args.rounds} rounds")
    print(f"{'mode':6s} {'wall s':>8s} {'per checkpoint s':>17s} {'step s':>8s}")
    for mode in MODES:
        wall = statistics.median(walls[mode])
        per = f"{(wall - base) / args.steps:17.2f}" if mode != "none" else f"{'-':>17s}"
        print(f"{mode:6s} {wall:8.1f} {per} {statistics.median(steps[mode]):8.3f}")
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
