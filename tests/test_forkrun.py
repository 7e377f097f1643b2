"""tests/forkrun.py, the launcher the training and profiling tests start their ranks with: each rank
gets torchrun's environment, and one rank failing stops the others and gives its exit status;
and tests/forkserver.py, which forks those launches from one import: a launch gets its own
environment, directory and output, and one that runs past its timeout is killed with its ranks."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from torchrun_helpers import REPO, env, ranks

PROBE = '''
import json, os, sys, time
import torch.distributed as dist

def main(argv):
    out = argv[0]
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
    dist.init_process_group("gloo")
    with open(f"{out}/rank{dist.get_rank()}.json", "w") as f:
        json.dump({k: os.environ.get(k) for k in keys} | {"argv": sys.argv, "pid": os.getpid(),
                   "start": open("/proc/self/stat").read().split()[21]}, f)
    dist.barrier()
    if argv[1] == "fail" and dist.get_rank() == 1:
        return 3
    if argv[1] in ("fail", "hang"):
        time.sleep(60)  # as a rank waiting for a peer that is gone, where nothing tells it
    dist.destroy_process_group()
    return 0
'''


def _launch(tmp_path, nproc, how):
    (tmp_path / "forkrun_probe.py").write_text(PROBE)
    e = env()
    e["PYTHONPATH"] = os.pathsep.join([str(tmp_path), e["PYTHONPATH"]])
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "forkrun.py"), str(nproc), "forkrun_probe",
                           str(tmp_path), how], cwd=REPO, env=e, capture_output=True, text=True, timeout=60)
    return proc, time.monotonic() - start


def _gone(rank: dict) -> bool:
    """Whether the rank's process has ended: no process of its pid, a zombie, or another process
    that took the pid since (another start time)."""
    try:
        stat = open(f"/proc/{rank['pid']}/stat").read().split()
    except FileNotFoundError:
        return True
    return stat[2] == "Z" or stat[21] != rank["start"]


def _ends(rank: dict, within: float = 10.0) -> bool:
    """Whether the rank's process ends within `within` seconds: one sent SIGKILL is gone only once
    the kernel has run its exit, which on a loaded host comes a while after the kill."""
    end = time.monotonic() + within
    while not _gone(rank):
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


def test_ranks_get_torchruns_environment_and_one_failure_stops_them_all(tmp_path):
    proc, _ = _launch(tmp_path, 3, "ok")
    assert proc.returncode == 0, proc.stderr
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    for r, g in enumerate(got):
        assert (g["RANK"], g["LOCAL_RANK"], g["WORLD_SIZE"], g["LOCAL_WORLD_SIZE"], g["GROUP_RANK"]) == \
            (str(r), str(r), "3", "3", "0")
        assert g["argv"] == ["forkrun_probe", str(tmp_path), "ok"]
    assert len({g["pid"] for g in got}) == 3 and len({g["MASTER_PORT"] for g in got}) == 1
    # rank 1 leaves with 3 while rank 0 waits on: rank 0 is stopped, the status is rank 1's
    proc, took = _launch(tmp_path, 2, "fail")
    assert proc.returncode == 3 and took < 30, (proc.returncode, took, proc.stderr[-2000:])
    assert "stopping the others" in proc.stderr
    for r in range(2):
        assert _gone(json.loads((tmp_path / f"rank{r}.json").read_text()))


def test_the_fork_server_runs_each_launch_apart_and_kills_one_past_its_timeout(tmp_path, monkeypatch):
    (tmp_path / "forkrun_probe.py").write_text(PROBE + "\nprint('said', os.getcwd(), os.environ.get('PROBE_MARK'))\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("PROBE_MARK", "first")
    proc = ranks(2, "forkrun_probe", tmp_path, "ok")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count(f"said {REPO} first") == 1  # printed at import, once, in the launcher
    assert json.loads((tmp_path / "rank1.json").read_text())["argv"] == ["forkrun_probe", str(tmp_path), "ok"]
    for r in range(2):
        (tmp_path / f"rank{r}.json").unlink()
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):  # long enough for the ranks to start on a loaded host
        ranks(2, "forkrun_probe", tmp_path, "hang", timeout=12)
    assert time.monotonic() - start < 40
    for r in range(2):
        assert _ends(json.loads((tmp_path / f"rank{r}.json").read_text()))  # this launch's rank, killed
    monkeypatch.setenv("PROBE_MARK", "second")  # the server goes on, and each launch has its environment
    proc = ranks(1, "forkrun_probe", tmp_path, "ok")
    assert proc.returncode == 0 and "second" in proc.stdout, proc.stderr
