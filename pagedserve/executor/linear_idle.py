"""Whether a linear timing was taken on an idle machine (for pagedserve.executor.linear_timing and linear_auto).

OtherWork() starts a watch over the CPUs this process may run on (os.sched_getaffinity);
share() is the fraction of their time since then that went to anything but this process:
their busy time in /proc/stat (user, nice, system, irq, softirq, steal) less this process's
CPU time, over wall time x CPUs. None where /proc/stat cannot be read (not Linux) or the
watch is too short for its 1/100 s ticks (MIN_WATCH_S).

why_busy(others, spread) says why a timing is not an idle one, or None: other work took more
than OTHERS_LIMIT of the CPUs, or one backend's rounds at one M differ by more than
SPREAD_LIMIT (pagedserve.executor.linear_timing.Timing says how the spread is taken). Only idle
timings are kept (pagedserve.executor.linear_plan_cache), and only they can move a shape off
oneDNN (pagedserve.executor.linear_auto; issue 44: a plan timed while
other work ran was kept for good and sent half the model's FLOPs to the slower backend).
"""
from __future__ import annotations

import os
import time

OTHERS_LIMIT = 0.15
SPREAD_LIMIT = 1.5
MIN_WATCH_S = 0.1
BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user nice system (idle iowait) irq softirq steal
STAT = "/proc/stat"


def busy_seconds(stat_text: str, cpus: set[int]) -> float:
    """Seconds the CPUs `cpus` spent busy, from the text of /proc/stat."""
    ticks = 0
    for line in stat_text.splitlines():
        name, _, rest = line.partition(" ")
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            fields = rest.split()
            ticks += sum(int(fields[i]) for i in BUSY_FIELDS if i < len(fields))
    return ticks / os.sysconf("SC_CLK_TCK")


def _cpus() -> set[int]:
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def _read_busy(cpus: set[int]) -> float | None:
    try:
        with open(STAT) as f:
            return busy_seconds(f.read(), cpus)
    except (OSError, ValueError, IndexError):
        return None


class OtherWork:
    """A watch of the CPU time other work takes on this process's CPUs."""

    def __init__(self):
        self.cpus = _cpus()
        self.busy = _read_busy(self.cpus)
        self.own = time.process_time()
        self.wall = time.perf_counter()

    def share(self) -> float | None:
        wall = time.perf_counter() - self.wall
        busy = _read_busy(self.cpus)
        if busy is None or self.busy is None or wall < MIN_WATCH_S:
            return None
        others = busy - self.busy - (time.process_time() - self.own)
        return max(0.0, others / (wall * len(self.cpus)))


def why_busy(others: float | None, spread: float) -> str | None:
    """Why a timing with these measures is not an idle one; None if it is."""
    if others is not None and others > OTHERS_LIMIT:
        return f"other work took {others:.0%} of this process's CPUs (limit {OTHERS_LIMIT:.0%})"
    if spread > SPREAD_LIMIT:
        return f"its rounds differed by {spread:.2f}x (limit {SPREAD_LIMIT}x)"
    return None
