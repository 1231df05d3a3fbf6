"""A steady step's fills, checked before anything acts and applied in the running growth's
pass over the same tables (pagedserve.memsvc.running_growth).

In a steady step made ahead, the plan's `fills` name its running sequences, in plan order,
each at its last position, which holds the PENDING token the previous step sampled. `check`
says so (every table held on the device, every fill valid there) or answers None, having
changed nothing; the caller then fills the reference way (PagedAllocator.fill_all) before
anything else. Checked fills do what `fill_all` would: each token in its place, a block it
completes keyed at once. They may be applied after the plan's frees, which the caller checks
name other sequences: a free touches no table of theirs and no key they record.
"""
from __future__ import annotations

from operator import sub
from typing import NamedTuple

from pagedserve.memsvc.block_table import BlockTable
from pagedserve.wire.pending_token import PENDING


class SteadyFills(NamedTuple):
    tables: list[BlockTable]  # the running sequences' tables, in plan order
    starts: list[int]  # each one's num_tokens
    token_ids: list[int]  # the id of each one's last token, now PENDING


def check(alloc, seq_ids: list[str], positions, token_ids) -> SteadyFills | None:
    """`alloc`: a PagedAllocator with prefix caching; (positions[i], token_ids[i]): the fill
    of seq_ids[i]."""
    n = len(seq_ids)
    tables = list(map(alloc._seqs.get, seq_ids))
    if not all(tables) or min(token_ids) < 0:
        return None
    starts = [t.num_tokens for t in tables]
    if list(map(sub, starts, positions)).count(1) != n:
        return None
    try:  # (a swapped-out table counts as True, never PENDING)
        if [t.swapped or t.tail_tokens[-1] for t in tables].count(PENDING) != n:
            return None
    except IndexError:  # an empty tail: no pending token there
        return None
    return SteadyFills(tables, starts, list(token_ids))


def apply(alloc, fills: SteadyFills) -> None:
    """The checked fills on their own (where the growth does not run them)."""
    bs, key = alloc.block_size, alloc._key_tail
    for table, token_id in zip(fills.tables, fills.token_ids):
        tail = table.tail_tokens
        tail[-1] = token_id
        if len(tail) == bs:  # it completed a block
            key(table)
