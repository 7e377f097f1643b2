"""The one-line error of a command that may run under torchrun (runtime.train, runtime.profile)."""
from __future__ import annotations

import os
import sys
import time

WAIT_S = 20.0


def fail(msg: str, code: int = 2) -> int:
    """Print `trident: error: MSG` once for the whole launch and return `code`.

    Rank 0 prints it. torchrun stops every rank as soon as one exits, so the others wait for rank 0
    to end first: bad input fails alike on every rank, and rank 0, started or importing later than
    the rest on a loaded host, must not be stopped before it has printed (a one-second wait lost
    the line in CI). A rank whose failure is its own is not stopped by rank 0: it prints the line
    itself, naming its rank, after WAIT_S."""
    rank = int(os.environ.get("RANK", "0"))
    if rank != 0:
        time.sleep(WAIT_S)
    print(f"trident: error: {msg}" if rank == 0 else f"trident: error: rank {rank}: {msg}",
          file=sys.stderr, flush=True)
    return code
