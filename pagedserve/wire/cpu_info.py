"""The CPU this process runs on, from /proc/cpuinfo (Linux): cpu_info() -> {"model_name", "isa"};
last_level_cache_bytes() from sysfs.

model_name is the first "model name" line ("unknown" where there is none); isa lists which
of ISA_FLAGS the first processor's "flags" line holds, in that order.
"""
from __future__ import annotations

import os

ISA_FLAGS = ("avx2", "avx512f", "amx_tile")
SIZE_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}  # sysfs cache sizes: "32768K"


def cpu_info(path: str = "/proc/cpuinfo") -> dict:
    name, flags = "unknown", set()
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and name == "unknown":
                    name = value.strip()
                elif key == "flags" and not flags:
                    flags = set(value.split())
                if name != "unknown" and flags:
                    break
    except OSError:
        pass
    return {"model_name": name, "isa": [f for f in ISA_FLAGS if f in flags]}


def describe(info: dict) -> str:
    return f"{info['model_name']} ({', '.join(info['isa']) or 'none of ' + '/'.join(ISA_FLAGS)})"


def last_level_cache_bytes(root: str = "/sys/devices/system/cpu/cpu0/cache") -> int | None:
    """The size of the first CPU's highest-level cache (Linux sysfs), or None if unknown."""
    best: tuple[int, int] | None = None
    try:
        for index in os.listdir(root):
            if not index.startswith("index"):
                continue
            with open(os.path.join(root, index, "level")) as f:
                level = int(f.read())
            with open(os.path.join(root, index, "size")) as f:
                size = f.read().strip()
            nbytes = int(size[:-1]) * SIZE_UNITS[size[-1]] if size[-1] in SIZE_UNITS else int(size)
            if best is None or level > best[0]:
                best = (level, nbytes)
    except (OSError, ValueError):
        return None
    return best[1] if best else None
