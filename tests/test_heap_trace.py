"""benchmarks/heap_trace.py: the heap of a run's memory-measuring step, operation by operation."""
import subprocess
import sys

import pytest

from runtime.metrics import HEAP_READER
from torchrun_helpers import REPO, env, write_plan


def test_the_heap_trace_shows_each_phase_and_what_is_alive(tmp_path):
    """A pp 2 1F1B plan of 4 micro-batches: both ranks' traces show every micro-batch's forward
    and backward, the operations around the peak, and at --at the storages alive there, the
    forward's activations among them."""
    if HEAP_READER is None:
        pytest.skip("the C library does not report its heap here")
    plan = write_plan(tmp_path, "pp2", world=2, pp=2, schedule="1f1b", micro_batch=2, global_batch=8)
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "heap_trace.py"), plan, "--at", "300"],
                          cwd=REPO, env=env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    for rank in (0, 1):
        part = out.split(f"== rank{rank}:")[1].split("== rank")[0]
        for phase in ("F0", "F3", "B0", "B3"):
            assert f"  {phase} " in part, (rank, phase, part[:2000])
        assert "peak " in part and "alive at op 300" in part, part[:2000]
    assert "aten.mm.default" in out.split("alive at op 300")[1]
