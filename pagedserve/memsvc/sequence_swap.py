"""Swapping a PagedAllocator's sequence out to the host SwapSpace and back.

Check, then act: `can_swap_out` / `swap_out`, `can_swap_in` / `swap_in`. Each act returns
(src, dst) block pairs for the caller to copy: device -> host before any later allocation
reuses the freed device blocks, host -> device before the sequence's next step. Shared
blocks are copied out too (they stay with their other holders); with a sliding window only
the live blocks travel. A swap-in keys again the blocks known written. Policy (when to
swap) is pagedserve.memsvc.preemption's; docs/ARCHITECTURE.md, "Prefix cache, sharing and
preemption".
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedserve.memsvc.paged_allocator import PagedAllocator


def can_swap_out(alloc: PagedAllocator, seq_id: str) -> bool:
    table = alloc._get(seq_id, on_device=False)
    return not table.swapped and len(table.live_blocks) <= alloc.swap_space.num_free


def swap_out(alloc: PagedAllocator, seq_id: str) -> list[tuple[int, int]]:
    """Move the sequence to host blocks; returns (device_block, host_block) pairs to copy
    before any later allocation reuses the device blocks. Shared blocks are copied too
    (and stay with their other holders)."""
    table = alloc._get(seq_id)
    live = table.live_blocks
    host = alloc.swap_space.allocate(len(live))
    pairs = [(b.block_id, h) for b, h in zip(live, host)]
    alloc.pool.free(reversed(live))
    table.blocks, table.host_blocks, table.swapped = [], host, True
    table.synced = 0
    return pairs


def can_swap_in(alloc: PagedAllocator, seq_id: str) -> bool:
    table = alloc._get(seq_id, on_device=False)
    return table.swapped and len(table.host_blocks) <= alloc.pool.num_free


def swap_in(alloc: PagedAllocator, seq_id: str) -> list[tuple[int, int]]:
    """Move the sequence back into fresh device blocks; returns (host_block,
    device_block) pairs to copy before the sequence's next step."""
    table = alloc._get(seq_id, on_device=False)
    if not table.swapped:
        raise ValueError(f"sequence {seq_id!r} is not swapped out")
    device = alloc.pool.allocate(len(table.host_blocks))
    pairs = [(h, b.block_id) for h, b in zip(table.host_blocks, device)]
    alloc.swap_space.free(table.host_blocks)
    table.blocks, table.host_blocks, table.swapped = [None] * table.released + device, [], False
    table.synced = 0
    for block, key in zip(device, table.block_keys[table.released:table.written]):
        alloc.pool.cache(block, key, table.salt)  # no-op where the key is still cached elsewhere
    if alloc.enable_prefix_caching:
        alloc._key_tail(table)  # blocks completed by a fill while swapped out
    return pairs
