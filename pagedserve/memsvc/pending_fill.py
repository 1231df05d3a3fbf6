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
    from pagedserve.wire.reserve_messages import Fills


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


def fill_all(self: PagedAllocator, fills: Fills, seq_ids: list[str] | None = None) -> None:
    """KVAllocator.fill_all: `fill` inline for each of `fills` (`seq_ids`: their ids, if
    known), one lookup per sequence. A pending token's index from the end of the tail is
    position - num_tokens (the keyed blocks and the tail hold every token)."""
    seqs, bs = self._seqs, self.block_size
    if seq_ids is None:
        seq_ids = fills.seq_ids
    if not self.enable_prefix_caching:
        for seq_id, token_id in zip(seq_ids, fills.token_ids):
            if token_id < 0 and seq_id in seqs:
                raise ValueError(f"token id must be >= 0, got {token_id}")
        return
    try:
        for seq_id, position, token_id in zip(seq_ids, fills.positions, fills.token_ids):
            table = seqs.get(seq_id)
            if table is None:
                continue
            if token_id < 0:
                raise ValueError(f"token id must be >= 0, got {token_id}")
            tail = table.tail_tokens
            j = position - table.num_tokens
            if j >= 0 or tail[j] != PENDING:  # (j < -len(tail): IndexError)
                raise IndexError
            tail[j] = token_id
            if len(tail) >= bs > len(tail) + j and not table.swapped:  # then a block may be keyable
                self._key_tail(table)
    except IndexError:
        raise ValueError(f"sequence {seq_id!r} has no pending token at position {position}") from None
