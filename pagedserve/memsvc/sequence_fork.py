"""Forks of a PagedAllocator's sequence: the child shares every block of its parent (each
ref count + 1), nothing allocated.

A write into a shared partial last block copies it first (copy-on-write, decided where the
sequence grows). `shared_tails` names the sequences whose partial last block another table
may hold too: a superset of those a growth would copy, which `may_copy` prunes, so that a
step where none copies takes the one-pass path (pagedserve.memsvc.running_growth).
docs/ARCHITECTURE.md, "Prefix cache, sharing and preemption".
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedserve.memsvc.paged_allocator import PagedAllocator


def fork(alloc: PagedAllocator, parent_id: str, child_id: str) -> None:
    parent = alloc._get(parent_id)
    if child_id in alloc._seqs:
        raise ValueError(f"sequence {child_id!r} is already registered")
    child = parent.fork(child_id)
    alloc.pool.incref(child.live_blocks)
    alloc._seqs[child_id] = child
    alloc.shared_tails.update((parent_id, child_id))


def may_copy(alloc: PagedAllocator) -> bool:
    """Some sequence's next growth may copy its last block: prunes `shared_tails` of
    those whose growth cannot."""
    seqs = alloc._seqs
    for seq_id in list(alloc.shared_tails):
        table = seqs.get(seq_id)
        if table is None or table.swapped or not alloc._needs_cow(table, 1):
            alloc.shared_tails.discard(seq_id)
    return bool(alloc.shared_tails)
