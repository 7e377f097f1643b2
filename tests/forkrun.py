"""Test launcher: run `runtime.train` or `runtime.profile` in N ranks on this machine as torchrun
would, but forked from one process that imported torch once.

    python tests/forkrun.py NPROC MODULE ARGS...

Each rank gets the environment torchrun gives a worker of a one-node job (RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, ROLE_RANK, MASTER_ADDR, MASTER_PORT) and calls
MODULE's main(ARGS), as `python -m MODULE ARGS` does. Why: on this project's 2-core test machines
a worker spends about 3.7 s of CPU importing torch and its distributed packages, and torchrun's
agent 2 s more, so an 8-rank launch spent some 30 s before its first step. Forked ranks share the
one import. What a launch must do as torchrun does, it does: the ranks' output goes to this
process's stdout and stderr; when a rank exits non-zero the others are stopped (SIGTERM, then
SIGKILL after STOP_GRACE_S); a rank dies with this launcher (PR_SET_PDEATHSIG), so a test's
timeout leaves nothing behind; the exit status is the first failing rank's.

torchrun itself stays under test where it is the subject: `trident run` and the one-line failures
under torchrun (tests/test_runtime_cli.py), two-node runs (tests/test_two_node.py) and the probes
that launch their own command. The project's modules read no environment at import (the ranks
would see the launcher's), and the launcher starts no thread before it forks (checked below)."""
from __future__ import annotations

import ctypes
import gc
import importlib
import os
import signal
import sys
import threading
import time
import traceback

STOP_GRACE_S = 5.0
PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """This process gets SIGKILL when its parent dies (PR_SET_PDEATHSIG); it ends now if the parent
    died before prctl took effect."""
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:
        os._exit(1)


def exit_with(body) -> None:
    """In a forked child: run body(), which returns an exit status as a module's main does, and
    leave with it, never returning into the caller's loop whatever happened; as the modules' own
    __main__ does, without interpreter teardown (gloo's threads)."""
    code = 1
    try:
        code = body()
    except SystemExit as exc:  # argparse's exit
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code if isinstance(code, int) else 0 if code is None else 1)


def _rank(module, r: int, nproc: int, port: int, args: list[str]) -> None:
    """In the forked child: become rank r and never return."""
    def body():
        die_with_parent()
        os.environ.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                          GROUP_RANK="0", ROLE_RANK=str(r), ROLE_WORLD_SIZE=str(nproc),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        sys.argv = [module.__name__, *args]
        return module.main(args)
    exit_with(body)


def run(nproc: int, module_name: str, args: list[str]) -> int:
    from runtime.launch import free_port
    module = importlib.import_module(module_name)
    assert threading.active_count() == 1, "forkrun: a thread started before the fork"
    # the imports' objects are never garbage: out of every collection the ranks make (a full one, as
    # runtime.metrics.PeakMemory makes before each measured step, took 0.13 s over them; ~0 s frozen)
    gc.freeze()
    port = free_port()
    sys.stdout.flush()
    sys.stderr.flush()
    pids = {}
    for r in range(nproc):
        pid = os.fork()
        if pid == 0:
            _rank(module, r, nproc, port, args)
        pids[pid] = r
    first_failure, stop_at = 0, None
    while pids:
        if stop_at is not None and time.monotonic() >= stop_at:
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            stop_at = float("inf")
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            time.sleep(0.05)
            continue
        pids.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and not first_failure:
            first_failure = code if code > 0 else 128 - code  # killed by a signal: 128 + its number
            print(f"forkrun: rank exited with {code}; stopping the others", file=sys.stderr, flush=True)
            for other in pids:
                os.kill(other, signal.SIGTERM)
            stop_at = time.monotonic() + STOP_GRACE_S
    return first_failure


if __name__ == "__main__":
    sys.exit(run(int(sys.argv[1]), sys.argv[2], sys.argv[3:]))
