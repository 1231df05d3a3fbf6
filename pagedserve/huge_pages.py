"""Transparent huge pages for torch's large CPU tensors, asked for before torch is imported.

torch's CPU allocator backs each allocation of 2 MiB or more with huge pages when
THP_MEM_ALLOC_ENABLE=1 (it aligns the block and calls madvise(MADV_HUGEPAGE)); the variable
is read once, at torch's first allocation. Where the kernel's transparent huge pages are
"madvise" (a common default) a process gets none without it. A decode step streams every
weight and the K/V it reads through the TLB; on 4 KiB pages that cost 2-4% of the step,
measured on an AMD EPYC (BENCHMARKS.md, issue 44). `ask()` sets the variable for this
process and the services it starts, from the command line's entry (pagedserve/cli.py), unless
it is set already (THP_MEM_ALLOC_ENABLE=0 turns this off) or torch is imported already (then
it is too late, and it says so). Docs: docs/ARCHITECTURE.md.
"""
from __future__ import annotations

import os
import sys

VARIABLE = "THP_MEM_ALLOC_ENABLE"


def ask() -> str:
    """Set THP_MEM_ALLOC_ENABLE=1 if it can still take effect; what was done, in words."""
    if VARIABLE in os.environ:
        return f"{VARIABLE}={os.environ[VARIABLE]} as set"
    if "torch" in sys.modules:
        return f"{VARIABLE} not set: torch was imported first, its allocator has read the environment"
    os.environ[VARIABLE] = "1"
    return f"{VARIABLE}=1 set"
