"""The CPU this process runs on, from /proc/cpuinfo (Linux): cpu_info() -> {"model_name", "isa"}.

model_name is the first "model name" line ("unknown" where there is none); isa lists which
of ISA_FLAGS the first processor's "flags" line holds, in that order.
"""
from __future__ import annotations

ISA_FLAGS = ("avx2", "avx512f", "amx_tile")


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
