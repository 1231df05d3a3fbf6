"""The id of one PENDING token of a PagedAllocator's sequence, once it is known: the
reference of `PagedAllocator.fill_all`, which a step calls for all of them at once.

A token planned ahead travels as PENDING (pagedserve.wire.pending_token) and keys no block
until its id is filled in; a fill that completes a block keys it (unless the sequence is
swapped out: then its swap-in does). ValueError where no token is pending at `position`.
docs/ARCHITECTURE.md, "The step path".
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from pagedserve.wire.pending_token import PENDING

if TYPE_CHECKING:
    from pagedserve.memsvc.paged_allocator import PagedAllocator


def fill(alloc: PagedAllocator, seq_id: str, position: int, token_id: int) -> None:
    if token_id < 0:
        raise ValueError(f"token id must be >= 0, got {token_id}")
    table = alloc._get(seq_id, on_device=False)
    if not alloc.enable_prefix_caching:
        return
    bs, tail = alloc.block_size, table.tail_tokens
    i = position - len(table.block_keys) * bs
    if not 0 <= i < len(tail) or tail[i] != PENDING:
        raise ValueError(f"sequence {seq_id!r} has no pending token at position {position}")
    tail[i] = token_id
    if i < bs <= len(tail) and not table.swapped:  # only then can a block become keyable
        alloc._key_tail(table)
