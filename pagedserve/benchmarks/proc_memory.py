"""A process's resident memory, from /proc/<pid>/status (Linux).

`resident(pid=None)` -> {"rss_bytes": VmRSS, "peak_rss_bytes": VmHWM} (this process when pid
is None); an empty dict where /proc cannot be read.
"""
from __future__ import annotations


def resident(pid: int | None = None) -> dict:
    fields = {"VmRSS": "rss_bytes", "VmHWM": "peak_rss_bytes"}
    out: dict = {}
    try:
        with open(f"/proc/{'self' if pid is None else pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in fields:
                    out[fields[key]] = int(value.split()[0]) * 1024  # kB
    except (OSError, ValueError):
        return {}
    return out
