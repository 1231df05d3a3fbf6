"""Where pagedserve keeps what it builds once per machine: one root for all of it.

cache_dir(*parts) is $PAGEDSERVE_CACHE, else $XDG_CACHE_HOME/pagedserve, else
~/.cache/pagedserve, joined with `parts`. Under it: `kernels/` (the C++ kernels' builds,
pagedserve/kernels/native_build.py), `models/` (GGUF files converted, pagedserve/executor/gguf_convert.py)
and `linear-plan.json` (the linear layers' timings, pagedserve/executor/linear_plan_cache.py).
A deployment that mounts a volume at $PAGEDSERVE_CACHE keeps all three there.
"""
from __future__ import annotations

import os

VARIABLE = "PAGEDSERVE_CACHE"


def cache_dir(*parts: str) -> str:
    base = os.environ.get(VARIABLE) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "pagedserve")
    return os.path.join(base, *parts)
