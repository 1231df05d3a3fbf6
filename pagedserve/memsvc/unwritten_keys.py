"""Prefix-cache keys waiting for the step that writes their blocks.

A full block's key is known when memsvc reserves the step that writes it (or fills the
token that completes it), long before its K/V exist. The key is published to the pool
(a prefix-cache hit for anyone) only once that step is known to have run: the Reserve
that keyed it records it here under its stamp, and the gateway's later plan confirms the
stamp (`Plan.written`) or voids it (`Plan.void`, `Plan.failed`). A block allocated again
in the meantime (its `gen` moved on) holds other contents: its record is dropped. So the
pool's key map holds only blocks whose contents were written (docs/ARCHITECTURE.md,
"Prefix cache, sharing and preemption").
"""
from __future__ import annotations

from collections.abc import Iterable

from pagedserve.memsvc.block_pool import Block, BlockPool
from pagedserve.memsvc.block_table import BlockTable

# (table, index in table.blocks, block, block.gen when keyed, key): a tuple, one per keyed block
Record = tuple[BlockTable, int, Block, int, bytes]


class UnwrittenKeys:
    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.stamp = 0  # the act (Reserve) now keying blocks
        self.by_stamp: dict[int, list[Record]] = {}

    def add(self, table: BlockTable, index: int, key: bytes) -> None:
        block = table.blocks[index]
        if block is None:  # left the sliding window before its last token was known: never published
            return
        self.by_stamp.setdefault(self.stamp, []).append((table, index, block, block.gen, key))

    def confirm(self, stamps: Iterable[int]) -> int:
        """Publish the keys recorded under `stamps` whose blocks still hold what was written
        (a free one moves to the tail of the free queue, a sequence's last blocks before its
        first, so those are evicted first); returns how many were published."""
        published = 0
        for stamp in stamps:  # a freed block keyed moves to the queue's tail: tail blocks first
            for table, index, block, gen, key in reversed(self.by_stamp.pop(stamp, ())):
                if block.gen != gen:
                    continue
                if self.pool.cache(block, key, table.salt):
                    published += 1
                if index >= table.written:
                    table.written = index + 1
        return published

    def drop(self, stamps: Iterable[int]) -> None:
        for stamp in stamps:
            self.by_stamp.pop(stamp, None)

    def drop_sequences(self, seq_ids: Iterable[str]) -> None:
        """Forget the unconfirmed keys of these sequences: their writes did not happen."""
        ids = set(seq_ids)
        if not ids:
            return
        for stamp, records in self.by_stamp.items():
            records[:] = [r for r in records if r[0].seq_id not in ids]

    def __len__(self) -> int:
        return sum(len(r) for r in self.by_stamp.values())
