"""Two emulated nodes on one machine (tests/cluster/netns.py): two network namespaces joined by a
veth shaped to 400 Mbit/s, one torchrun per namespace. Inside a node ranks talk through loopback,
across nodes through the shaped link, as on a real cluster's NVLink-vs-InfiniBand tiers.

Needs root, iproute2 and network namespaces; skipped with the reason otherwise.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap

import pytest

from cluster.netns import REPO, available, remove_stale, torchrun_two_nodes, two_nodes
from planner.build import build_plan
from planner.zoo import ZOO
from torchrun_helpers import assert_ok, assert_same_losses, losses_of, train

OK, WHY = available()
pytestmark = pytest.mark.skipif(not OK, reason=WHY)
SEQ_LEN = 32


def namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout


def both_ok(procs: list[subprocess.CompletedProcess]) -> None:
    for i, p in enumerate(procs):
        assert p.returncode == 0, f"node {i}: exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"


@pytest.fixture(scope="module")
def nodes():
    with two_nodes(rate_mbit=400, delay_ms=1.0) as h:
        yield h
    assert not any(n in namespaces() for n in h.names)


# -------------------------------------------------------------------- the two tiers
def test_an_all_reduce_across_nodes_is_much_slower_than_inside_one(nodes):
    procs = torchrun_two_nodes(nodes, [REPO / "tests/cluster/allreduce_tiers.py", "--mbytes", 16, "--reps", 3],
                               timeout=90)
    both_ok(procs)
    line = next(line for line in procs[0].stdout.splitlines() if line.startswith("TIERS_JSON "))
    tiers = json.loads(line.split(" ", 1)[1])
    assert tiers["world"] == 4 and tiers["nodes"] == 2 and tiers["bytes"] == 16 * 2**20
    # 400 Mbit/s is 50 MB/s; the two cross-node pairs share it, so the cross tier cannot beat it
    assert tiers["cross_busbw_Bps"] < 60e6, tiers
    assert tiers["cross_s"] > 3 * tiers["intra_s"], tiers


# -------------------------------------------------------------------- training across the nodes
def test_tp2_pp2_across_two_nodes_trains_like_one_process(nodes, tmp_path):
    steps = 3
    one = build_plan(ZOO["tiny"], cluster_name="cpu-test", device="cpu", nodes=1, devices_per_node=1,
                     global_batch=8, micro_batch=1, seq_len=SEQ_LEN, dtype="fp32")
    # mesh order pp, dp, tp: the tensor-parallel pair inside a node, the pipeline across the nodes
    two = build_plan(ZOO["tiny"], cluster_name="two-node-test", device="cpu", nodes=2, devices_per_node=2,
                     global_batch=8, micro_batch=1, seq_len=SEQ_LEN, tp=2, pp=2, dtype="fp32")
    one.write(tmp_path / "one.json")
    two.write(tmp_path / "two.json")
    assert_ok(train(1, "--plan", tmp_path / "one.json", "--steps", steps, "--out", tmp_path / "one.run.json",
                    timeout=120))
    procs = torchrun_two_nodes(nodes, ["-m", "runtime.train", "--plan", tmp_path / "two.json", "--steps", steps,
                                       "--out", tmp_path / "two.run.json"], timeout=120)
    both_ok(procs)
    run = json.loads((tmp_path / "two.run.json").read_text())
    assert run["world_size"] == 4
    assert_same_losses(run["losses"], losses_of(tmp_path / "one.run.json"), "tp2 x pp2 on two nodes")


def test_a_cluster_profile_measured_across_two_nodes_loads_with_both_tiers(nodes, tmp_path):
    """`trident profile cluster` across the nodes: the groups spanning them ({0,2}, {1,3} and
    {0,1,2,3}, two members a node) fit the inter-node tier, and the profile it writes loads (its
    groups' members_per_node was refused as an unknown field from 2026-11-29 to session 61, so no
    profile of two nodes of two or more processes was written)."""
    from planner.cluster import load_cluster
    out = tmp_path / "two.json"
    both_ok(torchrun_two_nodes(nodes, ["-m", "runtime.profile", "cluster", "--quick", "-o", out], timeout=180))
    c = load_cluster(str(out))
    assert (c.nodes, c.devices_per_node, c.node_of_rank) == (2, 2, [0, 0, 1, 1])
    raw = json.loads(out.read_text())["collectives"]["all_reduce"]["inter_node"]["by_group_size"]
    assert raw["4"]["members_per_node"] == 2 and "members_per_node" not in raw["2"]
    # the shaped link (400 Mbit/s, shared by a node's two ranks) is far slower than loopback
    intra, inter = (c.collectives["all_reduce"][t].at(2, 16 << 20)[1] for t in ("intra_node", "inter_node"))
    assert inter < intra / 3, (intra, inter)


# -------------------------------------------------------------------- nothing is left behind
def test_the_namespaces_and_their_processes_go_when_the_block_fails():
    with pytest.raises(ZeroDivisionError):
        with two_nodes() as h:
            names = h.names
            assert all(n in namespaces() for n in names)
            sleeper = h.popen(0, ["sleep", "60"])
            with pytest.raises(subprocess.TimeoutExpired):
                h.run(1, ["sleep", "60"], timeout=0.5)
            1 / 0
    assert sleeper.poll() is not None
    assert not any(n in namespaces() for n in names)


SCRIPT = textwrap.dedent("""
    import signal, sys, time
    # Ctrl-C as in a terminal, even when the test runs where SIGINT is ignored (a background job of a
    # shell without job control passes SIG_IGN down, and Python keeps an inherited SIG_IGN)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.path.insert(0, {tests!r})
    from cluster.netns import two_nodes
    with two_nodes() as h:
        h.popen(1, ["sleep", "60"])
        print(" ".join(h.names), flush=True)
        time.sleep(60)
""")


def _holder(tmp_path) -> tuple[subprocess.Popen, list[str]]:
    """A process that holds two nodes and sleeps; returns it and the names it created."""
    script = tmp_path / "hold.py"
    script.write_text(SCRIPT.format(tests=str(REPO / "tests")))
    proc = subprocess.Popen([sys.executable, script], stdout=subprocess.PIPE, text=True, cwd=REPO)
    names = proc.stdout.readline().split()
    if len(names) != 2 or not all(n in namespaces() for n in names):
        proc.terminate()
        proc.wait(timeout=30)
        proc.stdout.close()
        pytest.fail(f"the holder did not set up two nodes: {names}")
    return proc, names


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signalled_holder_removes_its_namespaces(tmp_path, sig):
    proc, names = _holder(tmp_path)
    try:
        proc.send_signal(sig)
        proc.wait(timeout=30)
        assert not any(n in namespaces() for n in names)
        if sig == signal.SIGTERM:
            assert proc.returncode == -sig  # it still dies of the signal, after cleaning up
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        proc.stdout.close()


def test_namespaces_of_a_killed_holder_are_removed_by_the_next_one(tmp_path):
    proc, names = _holder(tmp_path)
    proc.kill()
    proc.wait(timeout=10)
    proc.stdout.close()
    assert all(n in namespaces() for n in names)  # SIGKILL leaves them
    removed = remove_stale()
    assert set(names) <= set(removed)
    assert not any(n in namespaces() for n in names)
