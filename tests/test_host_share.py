"""Other work on a CPU host is seen and named: a profile or run measured beside it warns."""
import json
import subprocess
import sys

from planner.compare import busy_note
from runtime.host_share import _cpu_ticks, busy_host
from runtime.launch import free_port
from tests.torchrun_helpers import REPO, env


def test_the_notes_name_the_load_and_stay_quiet_without_one():
    assert "1.2 of this machine's 2 CPU cores" in busy_note(1.2, 2)
    assert busy_note(0.4, 2) is None and busy_note(None, 2) is None and busy_note(1.0, None) is None
    # two processes on two cores that computed as one: the cores were shared with other work
    assert "compute_slots measured 1.00 for 2 processes on 2 CPU cores" in busy_host(1.0, 2, 2)
    assert busy_host(1.9, 2, 2) is None
    assert busy_host(1.0, 1, 2) is None and busy_host(2.0, 8, 2) is None  # one process; one slot per core
    # the same slots with the cores idle while the ranks slept: not other processes, the cores themselves
    quiet = busy_host(1.0, 2, 2, other=0.1)
    assert "no other work seen" in quiet and "other processes" not in quiet
    assert "other processes were using" in busy_host(1.0, 2, 2, other=None)
    assert "other processes were using" in busy_host(1.0, 2, 2, other=1.5)


def test_only_this_process_cpus_are_read_from_proc_stat():
    stat = ("cpu  30 0 10 160 0 0 0 0 0 0\n"
            "cpu0 10 0 5 80 5 0 0 0 0 0\n"
            "cpu1 20 0 5 75 0 0 0 0 0 0\n"
            "cpu2 99 0 0 1 0 0 0 0 0 0\n"
            "intr 12345 0 0\n")
    assert _cpu_ticks({0, 1}, stat) == (40, 200)  # busy: all but idle and iowait; cpu2 and the total line left out
    assert _cpu_ticks({2}, stat) == (99, 100)
    assert _cpu_ticks({5}, stat) is None and _cpu_ticks({0}, "cpu0 1 x 3 4 5\n") is None


def test_a_busy_loop_beside_the_sleeping_ranks_is_seen():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           str(REPO / "tests" / "host_probe.py")]
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["busy_cores"] >= 0.7 and out["busy_cores"] >= out["idle_cores"] + 0.5
    assert "busy with other work" in out["busy_warning"]
    assert "busy with other work" in proc.stderr  # rank 0 printed it
    # a launch's plans: the second's "before" is the first's "after" and its compute_slots the
    # first's (at most FRESH_S old); 40 s on, both are measured again; rank 0's clock decides for both
    first = [["other_load", 0.0], ["compute_slots", 0.0], ["other_load", 1.0]]
    assert out["watch"] == [first + [["other_load", 6.0], ["other_load", 45.0], ["compute_slots", 45.0],
                                     ["other_load", 46.0]]] * 2
