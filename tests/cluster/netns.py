"""Two emulated nodes on one machine: two network namespaces joined by a shaped veth pair.

    with two_nodes(rate_mbit=400, delay_ms=1.0) as h:
        h.run(0, ["python3", "-c", "print(1)"], timeout=10)
        node0, node1 = torchrun_two_nodes(h, ["-m", "runtime.train", "--plan", "p.json"], timeout=120)

Each node is a network namespace (trident-n0-<pid>-<hex>, trident-n1-<pid>-<hex>) with `lo` up and
one end of a veth pair (td0-<hex> / td1-<hex>, 10.213.0.1/24 and 10.213.0.2/24). Both ends are
shaped with tc: `netem delay D rate R` where the kernel has netem, otherwise `tbf rate R` alone
(then the delay is not applied: `h.delay_applied` is False and `h.shaping` says "tbf"). The
kernel of the CI machine (6.18) has tbf and htb but no netem (nor fq, fq_codel, sfq, cake, hfsc),
so there the link is a rate limit only; tbf at 400 Mbit/s measures ~380 Mbit/s with one TCP stream.

Traffic between two processes of one node stays off the wire even when it uses the node's veth
address: an address of the namespace's own interface is routed through the namespace's local table
(loopback), which measures ~19 Gbit/s here against the veth's 400 Mbit/s. So setting
GLOO_SOCKET_IFNAME to the veth on every rank gives the two tiers of a real cluster: fast inside a
node, the shaped link between nodes. It has to be set: without it gloo takes the address of the
host name ("vm" -> 127.0.0.1 in /etc/hosts here), so a rank tells peers on the other node to reach
it at 127.0.0.1 and connectFullMesh fails with "Connection refused". GLOO_SOCKET_IFNAME=lo cannot
serve for the intra-node pairs either: gloo binds one address per process for all its peers, and
it is not needed, since the veth address already takes the loopback path inside a node. (c10d
warns "The hostname of the client socket cannot be retrieved": 10.213.0.x has no reverse name;
harmless.)

Cleanup is the point of this module: whatever happens (an exception, a failed test, Ctrl-C,
SIGTERM or SIGHUP, interpreter exit) the processes started through the harness are killed by
process group, any process still inside the namespaces is killed, and the namespaces (and with
them the veth pair) are deleted. On SIGTERM/SIGHUP (where their handler was the default) the
process then dies of the signal as it would have; Ctrl-C goes through KeyboardInterrupt.
Namespaces left by a process that was SIGKILLed are removed by the next `two_nodes()` (their names
carry the creating pid, and only those whose pid is dead are touched).

Nothing here contacts any address outside the two namespaces it creates.
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SUBNET = "10.213.0"
PREFIX = "trident-"
_OURS = re.compile(r"^trident-(?:n\d|probe)-(\d+)-[0-9a-f]+$")
_LIVE: set = set()  # harnesses not yet cleaned up, for atexit


def _ip(*args: str, check: bool = True, timeout: float = 10) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip() or proc.returncode}")
    return proc


def _tc(ns: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["tc", "-n", ns, *args], capture_output=True, text=True, timeout=10)
    if check and proc.returncode:
        raise RuntimeError(f"tc -n {ns} {' '.join(args)}: {proc.stderr.strip() or proc.returncode}")
    return proc


def _namespaces() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_namespace_pids(ns: str) -> None:
    """SIGKILL every process still inside namespace `ns` (only ever one this module created)."""
    for _ in range(3):
        pids = [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split() if p.isdigit()]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)


def _delete_namespace(ns: str) -> None:
    if ns in _namespaces():
        _kill_namespace_pids(ns)
        _ip("netns", "delete", ns, check=False)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Delete namespaces of this module whose creating process is gone (e.g. it was SIGKILLed).
    Returns their names. Namespaces of live processes (another test run) are left alone."""
    removed = []
    for ns in _namespaces():
        m = _OURS.match(ns)
        if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
            _delete_namespace(ns)
            removed.append(ns)
    return removed


@functools.lru_cache(maxsize=None)
def available() -> tuple[bool, str]:
    """(True, "") when this machine can run two_nodes(): root, `ip` and `tc`, and a trial namespace
    with a shaped veth can be created and deleted; else (False, why)."""
    if sys.platform != "linux":
        return False, "network namespaces need Linux"
    if os.geteuid() != 0:
        return False, "network namespaces need root"
    for tool in ("ip", "tc"):
        if not shutil.which(tool):
            return False, f"`{tool}` (iproute2) is not installed"
    tag = secrets.token_hex(2)
    ns, veth = f"{PREFIX}probe-{os.getpid()}-{tag}", f"tdp-{tag}"
    try:
        _ip("netns", "add", ns)
        _ip("link", "add", veth, "type", "veth", "peer", "name", veth + "b")
        _ip("link", "set", veth, "netns", ns)
        _ip("-n", ns, "link", "set", veth, "up")
        _tc(ns, "qdisc", "add", "dev", veth, "root", "tbf", "rate", "400mbit", "burst", "64kb", "latency", "50ms")
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        return False, f"cannot create a shaped network namespace: {exc}"
    finally:
        with contextlib.suppress(Exception):
            _delete_namespace(ns)
        with contextlib.suppress(Exception):
            _ip("link", "delete", veth + "b", check=False)
    if ns in _namespaces():
        return False, f"cannot delete the trial namespace {ns}"
    return True, ""


@dataclass
class Node:
    index: int
    netns: str  # namespace name
    ifname: str  # its end of the veth pair
    addr: str  # its address on the veth (no prefix length)


@dataclass
class TwoNodes:
    """What two_nodes() yields. `run`/`popen` start commands inside a node's namespace."""
    nodes: list[Node]
    rate_mbit: float
    delay_ms: float
    shaping: str = ""  # "netem" or "tbf"
    delay_applied: bool = False
    _procs: list = field(default_factory=list, repr=False)
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False)  # a signal may close mid-popen
    _closed: bool = field(default=False, repr=False)

    def __getitem__(self, i: int) -> Node:
        return self.nodes[i]

    @property
    def names(self) -> list[str]:
        return [n.netns for n in self.nodes]

    def command(self, node: int, cmd: list) -> list[str]:
        return ["ip", "netns", "exec", self.nodes[node].netns, *map(str, cmd)]

    def popen(self, node: int, cmd: list, env: dict | None = None, **kw) -> subprocess.Popen:
        """subprocess.Popen of `cmd` inside node `node`, in its own process group (killed on cleanup)."""
        if self._closed:
            raise RuntimeError("the two nodes are gone")
        kw.setdefault("cwd", REPO)
        proc = subprocess.Popen(self.command(node, cmd), env=env, start_new_session=True, **kw)
        with self._lock:
            self._procs.append(proc)
        return proc

    def run(self, node: int, cmd: list, env: dict | None = None, timeout: float = 60,
            **kw) -> subprocess.CompletedProcess:
        """Like subprocess.run(cmd, capture_output=True, text=True, timeout=timeout) inside node
        `node`; on timeout the whole process group is killed and TimeoutExpired raised."""
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.PIPE)
        kw.setdefault("text", True)
        proc = self.popen(node, cmd, env=env, **kw)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(proc.args, timeout, out, err) from None
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def kill_all(self) -> None:
        with self._lock:
            procs, self._procs = self._procs, []
        for p in procs:
            kill_group(p)

    def close(self) -> None:
        """Kill what runs in the nodes and delete the namespaces. Idempotent, never raises."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self.kill_all()
        for n in self.nodes:
            with contextlib.suppress(Exception):
                _delete_namespace(n.netns)
            with contextlib.suppress(Exception):  # a veth that never left the root namespace
                if _ip("link", "show", "dev", n.ifname, check=False).returncode == 0:
                    _ip("link", "delete", n.ifname, check=False)
        _unregister(self)

    __hash__ = object.__hash__
    __eq__ = object.__eq__


def kill_group(proc: subprocess.Popen, grace: float = 3.0) -> None:
    """SIGTERM the process group of `proc` (started with start_new_session), SIGKILL after `grace`."""
    if proc.poll() is not None:
        return  # what it left behind in a namespace goes with the namespace (close)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


@atexit.register
def _close_all() -> None:
    for h in list(_LIVE):
        h.close()


_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
_SAVED: dict = {}  # signal -> handler before ours, while ours is installed


def _on_signal(signum, frame) -> None:
    """SIGTERM/SIGHUP while nodes are up: clean up, then die of the signal as the process would have."""
    _close_all()
    signal.signal(signum, _SAVED.get(signum, signal.SIG_DFL))
    os.kill(os.getpid(), signum)


def _register(h) -> None:
    """Track a live harness; the first one installs the signal handlers where they are the default
    (from the main thread only; SIGINT needs none: KeyboardInterrupt runs the `finally`)."""
    _LIVE.add(h)
    if threading.current_thread() is threading.main_thread():
        for sig in _SIGNALS:
            if sig not in _SAVED and signal.getsignal(sig) in (signal.SIG_DFL, None):
                _SAVED[sig] = signal.signal(sig, _on_signal)


def _unregister(h) -> None:
    _LIVE.discard(h)
    if not _LIVE and threading.current_thread() is threading.main_thread():
        for sig in list(_SAVED):
            if signal.getsignal(sig) is _on_signal:
                signal.signal(sig, _SAVED[sig])
            del _SAVED[sig]


def _shape(ns: str, dev: str, rate_mbit: float, delay_ms: float, burst: int | None = None) -> str:
    """netem (delay + rate) where the kernel has it, else tbf (rate only). Returns which."""
    if delay_ms > 0:
        netem = _tc(ns, "qdisc", "add", "dev", dev, "root", "netem", "delay", f"{delay_ms}ms",
                    "rate", f"{rate_mbit}mbit", "limit", "10000", check=False)
        if netem.returncode == 0:
            return "netem"
    # burst: the bytes that pass at line speed before the rate applies. A burst of rate/HZ (200 KB
    # at 400 Mbit/s) lets every message up to ~200 KB through at loopback speed, so a TP activation
    # of the tiny model never feels the link; with a burst of a few packets (high-resolution timers
    # pace tbf; larger GSO packets are segmented) the rate holds from 32 KB messages on. Measured
    # here at 400 Mbit/s, cross-node all-reduce of 32 KB / 128 KB / 4 MB: 0.65 / 2.4 / 174 ms with
    # the 200 KB burst, 2.1 / 6.8 / 183 ms with 4 KB. latency bounds the queue.
    burst = burst or 4096
    _tc(ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst),
        "latency", "50ms")
    return "tbf"


@contextlib.contextmanager
def two_nodes(rate_mbit: float = 400, delay_ms: float = 1.0, burst: int | None = None):
    """Two namespaces joined by a veth pair shaped to `rate_mbit` each way (+ `delay_ms` where netem
    exists). Yields a TwoNodes; everything it created is removed on exit, however the block ends."""
    ok, why = available()
    if not ok:
        raise RuntimeError(why)
    with contextlib.suppress(Exception):
        remove_stale()
    tag = secrets.token_hex(3)
    nodes = [Node(i, f"{PREFIX}n{i}-{os.getpid()}-{tag}", f"td{i}-{tag}", f"{SUBNET}.{i + 1}") for i in (0, 1)]
    h = TwoNodes(nodes, rate_mbit, delay_ms)
    _register(h)
    try:
        for n in nodes:
            _ip("netns", "add", n.netns)
        _ip("link", "add", nodes[0].ifname, "type", "veth", "peer", "name", nodes[1].ifname)
        kinds = set()
        for n in nodes:
            _ip("link", "set", n.ifname, "netns", n.netns)
            _ip("-n", n.netns, "addr", "add", f"{n.addr}/24", "dev", n.ifname)
            _ip("-n", n.netns, "link", "set", "lo", "up")
            _ip("-n", n.netns, "link", "set", n.ifname, "up")
            kinds.add(_shape(n.netns, n.ifname, rate_mbit, delay_ms, burst))
        h.shaping = "netem" if kinds == {"netem"} else "tbf"
        h.delay_applied = h.shaping == "netem" and delay_ms > 0
        yield h
    finally:
        h.close()


# ------------------------------------------------------------------ torchrun across the two nodes
def node_env(h: TwoNodes, node: int, extra: dict | None = None) -> dict:
    """The environment of a process on node `node`: gloo on the veth, one thread, the repo importable."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=h.nodes[node].ifname,
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               PYTHONUNBUFFERED="1")
    env.update(extra or {})
    return env


def torchrun_two_nodes(h: TwoNodes, module_args: list, nproc_per_node: int = 2, timeout: float = 120,
                       port: int = 29500, env: dict | None = None,
                       python: str = sys.executable) -> list[subprocess.CompletedProcess]:
    """`python -m torch.distributed.run --nnodes 2 --node-rank R ... *module_args` on both nodes, the
    rendezvous on node 0's veth address. Returns both CompletedProcess (text stdout/stderr).

    Never hangs: past `timeout` seconds, or 20 s after one node failed (the other then waits for a
    peer that is gone), the remaining launches are killed with their process groups; a killed one
    gets returncode 124 and a note at the end of its stderr."""
    procs, files = [], []
    try:
        for r in (0, 1):
            cmd = [python, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", str(nproc_per_node),
                   "--node-rank", str(r), "--master-addr", h.nodes[0].addr, "--master-port", str(port),
                   "--max-restarts", "0", *map(str, module_args)]
            out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
            files.append((out, err))
            procs.append(h.popen(r, cmd, env=node_env(h, r, env), stdout=out, stderr=err, text=True))
        deadline, notes = time.monotonic() + timeout, ["", ""]
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            failed = any(p.returncode not in (None, 0) for p in procs)
            if failed:
                deadline = min(deadline, now + 20)
            if now >= deadline:
                for i, p in enumerate(procs):
                    if p.poll() is None:
                        kill_group(p)
                        notes[i] = (f"\n[netns: node {i} killed: "
                                    f"{'the other node failed' if failed else f'past the {timeout}s timeout'}]")
                        p.returncode = 124
                break
            time.sleep(0.1)
        results = []
        for i, (p, (out, err)) in enumerate(zip(procs, files)):
            out.seek(0), err.seek(0)
            results.append(subprocess.CompletedProcess(p.args, p.returncode, out.read(), err.read() + notes[i]))
        return results
    finally:
        for p in procs:
            kill_group(p)  # a no-op for those that ended
        for out, err in files:
            out.close(), err.close()
