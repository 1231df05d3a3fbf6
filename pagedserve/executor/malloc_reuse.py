"""Large activations reused from the heap rather than mapped afresh each step (CPU executor).

A prefill chunk's activations are megabytes each (the gate/up output of 2,048 rows of the
default model: 25 MB). glibc serves a block that large with its own mmap and unmaps it on
free, so every step touches fresh pages: the kernel faults in and zeroes each 4 KiB page
again, about 7% of a prefill step's time measured on an AMD EPYC (BENCHMARKS.md,
issue 44). `reuse_freed_memory()` raises glibc's mmap threshold to its maximum and keeps
freed memory in the heap instead of giving it back, so each step reuses the pages the last
one freed. The process then holds its peak step's activations for good, which it meets again
every prefill anyway. Elsewhere than glibc it does nothing. Docs: docs/ARCHITECTURE.md.
"""
from __future__ import annotations

import ctypes
import logging

M_TRIM_THRESHOLD = -1  # mallopt parameters, glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling on 64-bit (4 * 1024 * 1024 * sizeof(long))
TRIM_THRESHOLD = 1 << 30       # free memory above this at the heap's top goes back to the system

log = logging.getLogger("pagedserve.executor")


def _glibc() -> ctypes.CDLL | None:
    """The C library this process runs on, if it is glibc (its own symbols: no search, which
    would start ldconfig)."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018  (glibc only: musl and others lack it)
        libc.mallopt  # noqa: B018
        return libc
    except (OSError, AttributeError, TypeError):
        return None


def reuse_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds for this process; True when both took."""
    libc = _glibc()
    if libc is None:
        return False
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX))
    ok = bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)) and ok
    if not ok:
        log.warning("mallopt refused the mmap/trim thresholds: large activations are mapped afresh each step")
    return ok
