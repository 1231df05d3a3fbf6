"""One sequence's growth in the paged allocator, one sequence at a time: what a step that is
not a steady decode runs (a steady one grows all at once: pagedserve.memsvc.running_growth),
and the growth of a sequence just admitted or resumed. A check (`grow_if_fits`, or `grow`'s
NoFreeBlocks) comes before any change; a write into a shared partial last block copies it
first, and a sliding window frees what it left. See docs/ARCHITECTURE.md, "Allocation:
check, then act".
"""
from __future__ import annotations

from pagedserve.memsvc.allocator import AppendResult, Growth
from pagedserve.memsvc.block_pool import NoFreeBlocks
from pagedserve.memsvc.block_table import BlockTable, blocks_for


def release_outside_window(alloc, table: BlockTable) -> None:
    """Free the blocks wholly before the window of the next position to compute."""
    if alloc.window is None:
        return
    first_needed = table.num_tokens - alloc.window + 1
    upto = min(max(first_needed, 0) // alloc.block_size, len(table.blocks) - 1)
    if upto <= table.released:
        return
    gone = table.blocks[table.released:upto]
    table.blocks[table.released:upto] = [None] * len(gone)
    table.released = upto
    alloc.blocks_released += len(gone)
    alloc.pool.free(gone)


def append(alloc, seq_id: str, new_token_ids: list[int]) -> AppendResult:
    start = alloc._get(seq_id).num_tokens
    copies = grow(alloc, seq_id, new_token_ids)
    return AppendResult(alloc._seqs[seq_id].slots(start, len(new_token_ids)), copies)


def grow(alloc, seq_id: str, new_token_ids: list[int]) -> list[tuple[int, int]]:
    table = alloc._get(seq_id)
    release_outside_window(alloc, table)
    n = len(new_token_ids)
    cow = alloc._needs_cow(table, n)
    needed = blocks_for(table.num_tokens + n, alloc.block_size) - len(table.blocks) + cow
    if needed > alloc.pool.num_free:
        raise NoFreeBlocks(
            f"sequence {seq_id!r} needs {needed} blocks for {n} more tokens,"
            f" {alloc.pool.num_free} free"
        )
    return extend(alloc, table, new_token_ids, needed, cow)


def grow_if_fits(alloc, seq_id: str, new_token_ids: list[int]) -> Growth | None:
    """KVAllocator.grow_if_fits in one table lookup. The check counts the blocks free
    before the window release, as `can_append` does (the release never changes what
    the growth needs: it keeps the last block)."""
    table = alloc._get(seq_id, on_device=False)
    if table.swapped:
        return None
    num_tokens, n = table.num_tokens, len(new_token_ids)
    cow = alloc._needs_cow(table, n)
    needed = blocks_for(num_tokens + n, alloc.block_size) - len(table.blocks) + cow
    if needed > alloc.pool.num_free:
        return None
    release_outside_window(alloc, table)
    copies = extend(alloc, table, new_token_ids, needed, cow)
    return (num_tokens, copies, *alloc._table_changes(table))


def extend(alloc, table: BlockTable, new_token_ids: list[int], needed: int, cow: bool) -> list[tuple[int, int]]:
    """The act of `grow`, once the caller has checked that `needed` blocks are free."""
    copies: list[tuple[int, int]] = []
    if cow:
        src = table.blocks[-1]
        (dst,) = alloc.pool.allocate(1)
        alloc.pool.free([src])  # still held by the other sharers
        table.blocks[-1] = dst
        table.synced = min(table.synced, len(table.blocks) - 1)
        copies.append((src.block_id, dst.block_id))
        needed -= 1
    if needed:
        table.blocks.extend(alloc.pool.allocate(needed))
    table.num_tokens += len(new_token_ids)
    if alloc.enable_prefix_caching:
        table.tail_tokens.extend(new_token_ids)
        if len(table.tail_tokens) >= alloc.block_size:
            alloc._key_tail(table)
    return copies
