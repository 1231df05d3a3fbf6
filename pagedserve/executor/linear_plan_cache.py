"""The linear layers' timings kept per machine, so that a restart serves the same plan.

`--linear-backend auto` times each weight shape at load (pagedserve.executor.linear_backend). The
seconds measured are kept in `linear-plan.json` in pagedserve's cache (pagedserve/wire/cache_dir.py:
$PAGEDSERVE_CACHE, default ~/.cache/pagedserve), keyed by the CPU (model name and ISA), torch's version, the dtype, the
shape, the row counts and backends timed (and how: pagedserve.executor.linear_timing, KEPT_HOW); a later load on
the same machine takes them instead of timing again, so the plan and, by float rounding,
greedy outputs stay the same across restarts and replicas of one machine. Only timings taken
idle are stored, and a load checks them first (pagedserve.executor.linear_auto); the key names that
rule, so timings kept before it (some taken under load, issue 44) are not used. Delete the
file to time again. A file that cannot be read or written is logged and ignored: the shape is
timed as if none were kept.
"""
from __future__ import annotations

import json
import logging
import os
import tempfile

import torch

from pagedserve.executor.linear_timing import COLD_BELOW, TIMED
from pagedserve.kernels import linear_cpu, panel_cpu
from pagedserve.wire.cache_dir import cache_dir
from pagedserve.wire.cpu_info import cpu_info

BUILDS = {"dot": linear_cpu.VERSION, "panel": panel_cpu.VERSION}  # the C++ backends: their source's hash

FILE_NAME = "linear-plan.json"
KEPT_HOW = "idle only"
log = logging.getLogger("pagedserve.executor")


def path() -> str:
    return cache_dir(FILE_NAME)


def key(shape: tuple[int, int], dtype: torch.dtype, rows: tuple[int, ...],
        backends: tuple[str, ...] = TIMED) -> str:
    cpu = cpu_info()
    return (f"{cpu['model_name']} [{' '.join(cpu['isa'])}] {os.cpu_count()} CPUs | torch "
            f"{torch.__version__} | {dtype} | {shape[0]}x{shape[1]} | M {','.join(map(str, rows))} "
            f"| {','.join(backends)}{''.join(f' {b}@{v}' for b, v in BUILDS.items() if b in backends)} "
            f"(cold below {COLD_BELOW}, {KEPT_HOW})")


def _read(file: str) -> dict:
    try:
        with open(file) as f:
            kept = json.load(f)
        return kept if isinstance(kept, dict) else {}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        log.warning("linear plan cache %s unreadable (%s): timing again", file, e)
        return {}


def load(k: str) -> dict[int, dict[str, float]] | None:
    """The seconds kept under `k` ({M: {backend: seconds}}), or None."""
    entry = _read(path()).get(k)
    try:
        return {int(m): {b: float(s) for b, s in t.items()} for m, t in entry.items()} if entry else None
    except (AttributeError, TypeError, ValueError):
        return None


def store(k: str, seconds: dict[int, dict[str, float]]) -> None:
    file = path()
    kept = _read(file)
    kept[k] = {str(m): t for m, t in seconds.items()}
    try:
        os.makedirs(os.path.dirname(file), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(file), prefix=".linear-plan-")
        with os.fdopen(fd, "w") as f:
            json.dump(kept, f, indent=1, sort_keys=True)
        os.replace(tmp, file)  # whole or not at all, if two processes write at once
    except OSError as e:
        log.warning("linear plan cache %s not written (%s)", file, e)
