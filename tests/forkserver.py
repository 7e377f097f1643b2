"""The tests' fork server: one process that imports torch and the runtime once for the whole test
session, and forks a launcher for every launch the tests ask for (tests/torchrun_helpers.ranks
and train), which runs the ranks as tests/forkrun.py does, or one plain process.

    python tests/forkserver.py    (started by torchrun_helpers; requests on stdin, one per line)

Why: tests/forkrun.py shares one import among a launch's ranks, but each launch still spent
about 3.7 s of one core importing torch and runtime.train before its ranks forked, and a
one-process run as much; the suite launches some fifty times. A launch forked from here starts
from the imported modules instead.

The protocol, JSON lines: a request {"nproc", "module", "args", "cwd", "env", "stdout", "stderr"}
(nproc null: one plain process; the last two: files the launch writes its output to) is
answered by {"pid": P} once forked, and by {"code": C} when it ends (its exit status; -N when
killed by signal N, as subprocess says it). The launch runs in its own process group (P's), so
a caller that gives up kills the launch and its ranks with killpg; the ranks also die with their
launcher, and the launcher and this server with their parents (forkrun.die_with_parent). The server reads no environment for a launch: each
gets the request's environment, directory and argv, as a fresh `python -m` would, and the
launches never run in this process, so each starts from the state right after the imports.
The server starts no thread (forkrun checks it in each launcher)."""
from __future__ import annotations

import gc
import importlib
import json
import os
import sys

import forkrun

PRELOAD = ("runtime.train", "runtime.profile")  # what the launches import: torch and its distributed packages


def _launch(req: dict) -> None:
    """In the forked launcher: become the launch the request describes and never return."""
    def body():
        os.setpgid(0, 0)
        forkrun.die_with_parent()
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        # as a fresh interpreter would put the request's PYTHONPATH on sys.path (this one read its own)
        sys.path[1:1] = [p for p in req["env"].get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY),
                                (1, req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                                (2, req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
            f = os.open(path, flags, 0o644)
            os.dup2(f, fd)
            os.close(f)
        if req["nproc"] is not None:
            return forkrun.run(req["nproc"], req["module"], req["args"])
        module = importlib.import_module(req["module"])  # as `python -m MODULE ARGS` runs it
        sys.argv = [module.__file__, *req["args"]]
        return module.main(req["args"])
    forkrun.exit_with(body)


def _answer(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def serve() -> None:
    forkrun.die_with_parent()
    for name in PRELOAD:
        importlib.import_module(name)
    gc.freeze()  # as tests/forkrun.py does: a one-process launch's collections pass over no import's objects
    _answer({"ready": True})
    for line in sys.stdin:  # one launch at a time; the caller's end of stdin stops the server
        req = json.loads(line)
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _launch(req)
        _answer({"pid": pid})
        _, status = os.waitpid(pid, 0)
        _answer({"code": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    serve()
