"""Launching the runtime from tests: plans of the tiny models written for CPU, `runtime.train` and
`runtime.profile` in several gloo ranks (tests/forkrun.py: forked as torchrun would start them,
sharing one import of torch; each launch forked from tests/forkserver.py, which imported torch
and the runtime once for the session), and the checks on what a run reports. Shared by the test modules
that train or profile (test_runtime.py and the others)."""
from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from planner.build import build_plan
from planner.zoo import ZOO

REPO = Path(__file__).resolve().parent.parent
SEQ_LEN = 32
GLOBAL_BATCH = 8


def write_plan(directory: Path, name: str, model="tiny", world: int = 1, seq_len: int = SEQ_LEN, **kw) -> Path:
    """A CPU plan of a model (zoo name or ModelConfig) on one node of `world` devices, written to
    directory/name.json."""
    kw.setdefault("global_batch", GLOBAL_BATCH)
    kw.setdefault("micro_batch", 2)
    cfg = ZOO[model] if isinstance(model, str) else model
    kw.setdefault("dtype", "fp32")
    plan = build_plan(cfg, cluster_name="cpu-test", device="cpu", nodes=1, devices_per_node=world,
                      seq_len=seq_len, **kw)
    path = Path(directory) / f"{name}.json"
    plan.write(path)
    return path


def env() -> dict:
    e = dict(os.environ, OMP_NUM_THREADS="1")
    e["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), e.get("PYTHONPATH")]))
    return e


class _ForkServer:
    """The client of tests/forkserver.py: started on first use, one for the test session (it
    ends with the session: the end of its stdin, or its parent's death)."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "forkserver.py")], cwd=REPO, env=env(),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        self.buf = b""
        if "ready" not in (self._answer(timeout=120) or {}):
            raise RuntimeError("tests/forkserver.py did not start")

    def _answer(self, timeout: float | None) -> dict:
        """The server's next line; None at `timeout` seconds."""
        end = None if timeout is None else time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buf:
            left = None if end is None else max(0.0, end - time.monotonic())
            if not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError(f"tests/forkserver.py ended (exit {self.proc.wait()})")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def launch(self, nproc: int | None, module: str, args: list[str], timeout: float) -> subprocess.CompletedProcess:
        """`module` in `nproc` ranks (tests/forkrun.py), or as one plain process where nproc is None."""
        cmd = [sys.executable, *(["-m"] if nproc is None else ["tests/forkrun.py", str(nproc)]), module, *args]
        with tempfile.TemporaryDirectory() as d:
            out, err = Path(d) / "stdout", Path(d) / "stderr"
            req = {"nproc": nproc, "module": module, "args": args, "cwd": str(REPO), "env": env(),
                   "stdout": str(out), "stderr": str(err)}
            self.proc.stdin.write((json.dumps(req) + "\n").encode())
            started = self._answer(timeout=60)
            if started is None:
                raise RuntimeError("tests/forkserver.py did not fork the launch within 60 s")
            pid = started["pid"]
            done = self._answer(timeout)
            if done is None:  # the launch and its ranks, as subprocess.run's timeout kills its child
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:  # it ended meanwhile
                    pass
                self._answer(timeout=60)
                raise subprocess.TimeoutExpired(cmd, timeout, out.read_text(errors="replace"),
                                                err.read_text(errors="replace"))
            return subprocess.CompletedProcess(cmd, done["code"], out.read_text(errors="replace"),
                                               err.read_text(errors="replace"))


_SERVER: list[_ForkServer] = []


def ranks(nproc: int | None, module: str, *args, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGS` in `nproc` gloo ranks on this machine (tests/forkrun.py), or in one
    plain process where nproc is None: forked by the session's tests/forkserver.py."""
    if not _SERVER or _SERVER[0].proc.poll() is not None:
        _SERVER[:] = [_ForkServer()]
    return _SERVER[0].launch(nproc, module, [str(a) for a in args], timeout)


def profile_ranks(nproc: int, *args, timeout: float = 120) -> subprocess.CompletedProcess:
    """runtime.profile with these arguments in `nproc` gloo ranks."""
    return ranks(nproc, "runtime.profile", *args, timeout=timeout)


def train(nproc: int, *args, timeout: float = 300) -> subprocess.CompletedProcess:
    """runtime.train with these arguments: in one plain process when nproc == 1, else in nproc ranks."""
    return ranks(nproc if nproc > 1 else None, "runtime.train", *args, timeout=timeout)


def losses_of(run_json: Path) -> list[float]:
    return json.loads(Path(run_json).read_text())["losses"]


def assert_ok(proc: subprocess.CompletedProcess) -> None:
    """The run exited 0; else its output's end and, where the ranks' errors are longer than that,
    the first error from its start (the rank that failed first writes it before the others echo
    the broken connections it leaves)."""
    if proc.returncode == 0:
        return
    err = proc.stderr
    first = min((i for i in (err.find("Traceback"), err.find("malloc"), err.find("Fatal Python")) if i >= 0),
                default=-1)
    head = f"\n-- the first error --\n{err[first:first + 4000]}\n-- the end --" if 0 <= first < len(err) - 6000 else ""
    raise AssertionError(f"exit {proc.returncode}\n{proc.stdout[-3000:]}{head}\n{err[-6000:]}")


def assert_same_losses(got: list[float], want: list[float], what: str) -> None:
    assert len(got) == len(want), f"{what}: {len(got)} losses, want {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= 1e-4 * abs(w), f"{what}: step {i + 1} loss {g!r} but one process gives {w!r}"


def assert_resumes_exactly(plan, tmp_path, steps: int, nproc: int = 2):  # a run checkpointed halfway, resumed
    half, straight, resumed = steps // 2, tmp_path / "straight", tmp_path / "resumed"
    assert_ok(train(nproc, "--plan", plan, "--steps", steps, "--checkpoint-dir", straight, "--checkpoint-every", half,
                    "--out", tmp_path / "straight.json"))
    shutil.copytree(straight / f"step-{half}", resumed / f"step-{half}")  # only the halfway checkpoint
    assert_ok(train(nproc, "--plan", plan, "--steps", steps, "--checkpoint-dir", resumed, "--resume",
                    "--out", tmp_path / "resumed.json"))
    got, want = losses_of(tmp_path / "resumed.json"), losses_of(tmp_path / "straight.json")
    assert len(got) == steps - half and len(want) == steps
    assert_same_losses(got, want[half:], "resumed")
