"""`python -m runtime.torchrun ARGS`: torchrun (same arguments) that ends in one line, not a traceback.

torchrun reports a failed worker by raising ChildFailedError at its top level, which prints a
Python traceback under the worker's own message. `trident run` starts training through this
wrapper so that a failure reads as the worker's line plus one summary line, exit status 1.
"""
from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    import logging

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # torch elastic's own lines about stopping the other workers: the summary below says it
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)

    try:
        run(parse_args(argv))
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        how = f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit status {failure.exitcode}"
        print(f"trident: error: the run stopped: rank {rank} ended with {how} (its message is above)",
              file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
