"""How many compute threads the executor runs on a CPU now: one per core that other
processes leave it.

Every `interval` seconds `CoreShare.adjust` reads the busy time of the cores this process may
run on (/proc/stat: user, nice, system, irq, softirq and steal, so a hypervisor's share
counts) and this process's own CPU time; what the others used is the difference. The thread
count becomes the cores less the others' share (rounded down from 0.6 of a core on), at
least 1 and at most what it started with, once two windows in a row agree. Why: torch's
OpenMP threads wait for each other at every parallel region, so one thread that another
process keeps off its core stalls the rest (a one-sequence decode step went from 40 to
928 ms with one core taken, BENCHMARKS.md, "Side by side with vLLM-CPU"). OMP_NUM_THREADS,
or FIXED_THREADS_ENV (the tests set it: runs they compare share their arithmetic), fixes the
count instead. See docs/ARCHITECTURE.md, "The three services".
"""
from __future__ import annotations

import os
import time
from typing import Callable

import torch

FIXED_THREADS_ENV = "PAGEDSERVE_FIXED_THREADS"
DROP_AT = 0.6  # of a core used by others, over a window: one thread fewer
INTERVAL_S = 0.5


def busy_seconds(cpus: set[int], path: str = "/proc/stat") -> float:
    """Seconds the `cpus` spent busy since boot, for every process (steal included)."""
    tick = os.sysconf("SC_CLK_TCK")
    busy = 0
    with open(path) as f:
        for line in f:
            if not line.startswith("cpu") or line.startswith("cpu "):
                continue
            name, *fields = line.split()
            if int(name[3:]) in cpus:
                user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
                busy += user + nice + system + irq + softirq + steal
    return busy / tick


def own_seconds() -> float:
    t = os.times()
    return t.user + t.system


class CoreShare:
    """adjust() before a step; `threads` is the count in force (torch.set_num_threads)."""

    def __init__(self, interval: float = INTERVAL_S, clock: Callable[[], float] = time.monotonic,
                 busy: Callable[[], float] | None = None, own: Callable[[], float] = own_seconds,
                 set_threads: Callable[[int], None] = torch.set_num_threads, max_threads: int | None = None):
        cpus = os.sched_getaffinity(0)
        self.cores = len(cpus)
        self.max_threads = max_threads or torch.get_num_threads()
        self.threads = self.max_threads
        self.interval, self.clock, self.own, self.set_threads = interval, clock, own, set_threads
        self.busy = busy or (lambda: busy_seconds(cpus))
        self.changes = 0
        self._proposed: int | None = None
        self._mark = (self.clock(), self.busy(), self.own())

    @classmethod
    def for_this_process(cls) -> "CoreShare | None":
        """None where the count is fixed (OMP_NUM_THREADS, FIXED_THREADS_ENV) or /proc/stat
        cannot be read."""
        if (os.environ.get("OMP_NUM_THREADS") or os.environ.get(FIXED_THREADS_ENV)
                or not hasattr(os, "sched_getaffinity")):
            return None
        try:
            return cls()
        except (OSError, ValueError):
            return None

    def others(self) -> float | None:
        """Cores the other processes used since the last window, or None within a window."""
        now = self.clock()
        then, busy0, own0 = self._mark
        if now - then < self.interval:
            return None
        busy, own = self.busy(), self.own()
        self._mark = (now, busy, own)
        return max(0.0, (busy - busy0) - (own - own0)) / (now - then)

    def adjust(self) -> int:
        others = self.others()
        if others is None:
            return self.threads
        want = max(1, min(self.max_threads, self.cores - int(others + 1 - DROP_AT)))
        if want == self.threads:
            self._proposed = None
        elif want == self._proposed:
            self.threads, self._proposed = want, None
            self.set_threads(want)
            self.changes += 1
        else:
            self._proposed = want
        return self.threads
