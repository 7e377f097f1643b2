"""How processes share this host's CPU cores: compute_slots (written to a cluster profile; the
planner's schedule simulator shares them, planner.schedule.Sharing) and a check that no other
work was using the cores while a profile was measured (host_warning): a profile measured beside
other work prices every plan as on a busy machine, and the plans then run faster or slower than
predicted depending on the load of the moment."""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from planner.compare import OTHER_LOAD_SHARE, busy_note

BUSY_SHARE = 0.75  # compute slots measured below this share of the expected: the host was busy
LOAD_WINDOW_S = 0.5


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def compute_slots() -> float:
    """How many ranks compute at full speed at once: a 256^3 matmul loop timed on rank 0 alone
    (the others wait) and on every rank at once from a barrier, until the last rank finishes;
    world x alone / together, within [1, world]. Processes sharing CPU cores give the core count;
    devices with their own compute give the world size."""
    world = dist.get_world_size()
    a, b = torch.randn(256, 256), torch.randn(256, 256)

    def work():
        for _ in range(120):
            a @ b
    work()
    alone, together = [], []
    for _ in range(3):
        dist.barrier()
        if dist.get_rank() == 0:
            alone.append(_timed(work))
        dist.barrier()
    for _ in range(3):
        dist.barrier()
        t = torch.tensor([_timed(work)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the work of all ranks is done when the last one ends
        together.append(float(t))
    t = torch.tensor([statistics.median(alone) if alone else 0.0], dtype=torch.float64)
    dist.all_reduce(t)
    return min(float(world), max(1.0, world * float(t) / statistics.median(together)))


def busy_host(slots: float, procs: int, cores: int | None = None, other: float | None = None) -> str | None:
    """A warning when `procs` processes computed together at fewer than BUSY_SHARE x min(procs,
    cores) full-speed slots (`cores`: this process's CPUs, os.sched_getaffinity): every time
    measured meanwhile is that of a slower machine than this one is when quiet. `other`: cores
    other work kept busy while the ranks slept (other_load); where it saw none, nothing on this
    machine's cores was running, and the cores themselves gave less (a virtual machine's CPUs
    sharing the host's cores with its neighbours, or SMT siblings), which the warning says instead
    of blaming other processes. Ranks on other hosts only raise the slots measured, so the check
    never warns wrongly for them."""
    cores = len(os.sched_getaffinity(0)) if cores is None else cores
    expected = min(procs, cores)
    if slots >= BUSY_SHARE * expected:
        return None
    head = f"compute_slots measured {slots:.2f} for {procs} processes on {cores} CPU cores (about {expected} expected)"
    if other is not None and other <= OTHER_LOAD_SHARE * cores:
        return (f"{head}, with no other work seen on them ({other:.1f} busy while the ranks slept): the cores gave "
                f"less than their count when all computed at once (a virtual machine's CPUs sharing the host's "
                f"cores, or SMT siblings), so every time in this profile is that of the machine as it was then "
                f"and may not hold later; profile right before the runs you compare")
    return (f"{head}: other processes were using this machine's cores, and every time in this profile is "
            f"that of a busy machine; profile (and run) with the machine otherwise idle")


def _cpu_ticks(cores, text: str | None = None) -> tuple[int, int] | None:
    """(busy, total) jiffies of the CPUs `cores` in /proc/stat (Linux; or in `text`, its
    contents), or None where unreadable."""
    try:
        lines = (open("/proc/stat").read() if text is None else text).splitlines()
    except OSError:
        return None
    busy = total = 0
    for line in lines:
        name, *vals = line.split() or [""]
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores and len(vals) >= 5:
            try:
                v = [int(x) for x in vals[:8]]  # user nice system idle iowait irq softirq steal (guest is in user)
            except ValueError:
                return None
            total += sum(v)
            busy += sum(v) - v[3] - v[4]
    return (busy, total) if total else None


def busy_cores(seconds: float = LOAD_WINDOW_S) -> float | None:
    """How many of this process's CPUs (os.sched_getaffinity) were busy over the next `seconds`,
    from /proc/stat; None where it cannot be read."""
    cores = os.sched_getaffinity(0)
    before = _cpu_ticks(cores)
    time.sleep(seconds)
    after = _cpu_ticks(cores)
    if before is None or after is None or after[1] <= before[1]:
        return None
    return len(cores) * (after[0] - before[0]) / (after[1] - before[1])


def other_load(seconds: float = LOAD_WINDOW_S) -> float | None:
    """Cores of rank 0's host kept busy by other work: every rank sleeps `seconds` while rank 0
    reads busy_cores."""
    dist.barrier()
    if dist.get_rank() == 0:
        busy = busy_cores(seconds)
    else:
        busy = None
        time.sleep(seconds)
    t = torch.tensor([-1.0 if busy is None else busy], dtype=torch.float64)
    dist.broadcast(t, 0)
    return None if float(t) < 0 else float(t)


FRESH_S = 30.0  # a launch's host figures this recent stand for the next plan's "before"
RUN_WINDOW_S = 0.2  # other_load's window around a plan's steps


class HostWatch:
    """The host figures a launch records around each plan's steps (CPU ranks; GPUs: none): the
    cores other work kept busy while the ranks slept, before and after the steps (other_load), and
    compute_slots right before them. A launch trains its plans one after another, so a plan's
    "before" is the previous plan's "after" and compute_slots the launch's last, when measured at
    most FRESH_S seconds ago (one plan's set-up away): each is measured once, not twice, a plan;
    older, they are measured again (a shared or virtual machine changes speed over minutes).
    `clock`: time.monotonic, or a stand-in."""

    def __init__(self, cpu: bool, world: int, clock=time.monotonic):
        self.cpu, self.world, self.clock = cpu, world, clock
        self._other: tuple[float, float | None] | None = None  # (when, busy cores)
        self._slots: tuple[float, float] | None = None

    def _stale(self) -> tuple[bool, bool]:
        """Whether other_load and compute_slots are to be measured again: rank 0's clock decides
        for every rank (each measurement is collective, and the ranks' clocks differ)."""
        now = self.clock()
        flags = torch.tensor([float(seen is None or now - seen[0] > FRESH_S) for seen in (self._other, self._slots)])
        dist.broadcast(flags, 0)
        return bool(flags[0]), bool(flags[1])

    def before(self) -> tuple[float | None, float | None]:
        """(other work's busy cores, compute_slots) before a plan's steps; (None, None) on GPUs,
        compute_slots None for one process."""
        if not self.cpu:
            return None, None
        other, slots = self._stale()
        if other:
            self._measure_other()
        if self.world > 1 and slots:
            self._slots = (self.clock(), compute_slots())
        return self._other[1], self._slots[1] if self.world > 1 else None

    def after(self) -> float | None:
        """Other work's busy cores right after a plan's steps (None on GPUs)."""
        return self._measure_other() if self.cpu else None

    def _measure_other(self) -> float | None:
        self._other = (self.clock(), other_load(RUN_WINDOW_S))
        return self._other[1]


def host_warning(slots: float | None = None, lead: str = "") -> str | None:
    """On a CPU, every rank at once: the warning (printed by rank 0) when other work keeps the
    cores busy while the ranks sleep (other_load, planner.compare.busy_note) or when the ranks
    computing together get too few slots (busy_host; `slots`: compute_slots already measured, else
    measured now); None where neither, and on GPUs (each rank its own). `lead` goes before the
    printed line (a newline to end a progress bar's line)."""
    from runtime.device import current
    if current().type != "cpu":
        return None
    other, cores = other_load(), len(os.sched_getaffinity(0))
    warning = (busy_note(other, cores)
               or busy_host(compute_slots() if slots is None else slots, dist.get_world_size(), cores, other))
    if warning and dist.get_rank() == 0:
        print(f"{lead}trident profile: warning: {warning}", file=sys.stderr, flush=True)
    return warning
