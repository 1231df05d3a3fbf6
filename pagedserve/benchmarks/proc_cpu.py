"""CPU seconds a process has used, all its threads, from /proc/<pid>/stat (Linux).

`cpu_seconds(pid)` is utime + stime (fields 14 and 15, after the parenthesized command name,
which may hold spaces) over the clock ticks per second; `pid=None` reads this process.
Children's time (cutime, cstime) is not included.
"""
from __future__ import annotations

import os


def cpu_seconds(pid: int | None = None) -> float:
    with open(f"/proc/{'self' if pid is None else pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    utime, stime = int(fields[11]), int(fields[12])  # fields 14, 15 counted from the pid
    return (utime + stime) / os.sysconf("SC_CLK_TCK")
