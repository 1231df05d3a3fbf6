"""The block pool's own integrity check: its free queue, reference counts and cache map
agree (IntegrityError otherwise). The allocator's whole check is
pagedserve.memsvc.paged_integrity. See docs/ARCHITECTURE.md, "Allocation: check, then act".
"""
from __future__ import annotations

from pagedserve.memsvc.block_pool import BlockPool, IntegrityError

def check_pool(self: BlockPool) -> None:
    """Free queue and key map agree with the ref counts; IntegrityError otherwise."""
    seen: set[int] = set()
    prev = self.free_queue._head
    for block in self.free_queue:
        if block.prev_free is not prev:
            raise IntegrityError(f"free queue: block {block.block_id} has a broken back link")
        if block.block_id in seen:
            raise IntegrityError(f"free queue: block {block.block_id} appears twice")
        if block.ref_cnt != 0:
            raise IntegrityError(
                f"free queue: block {block.block_id} has ref count {block.ref_cnt}"
            )
        seen.add(block.block_id)
        prev = block
    if len(seen) != self.free_queue.num_free:
        raise IntegrityError(
            f"free queue holds {len(seen)} blocks but counts {self.free_queue.num_free}"
        )
    for block in self.blocks:
        if block.ref_cnt < 0:
            raise IntegrityError(f"block {block.block_id} has ref count {block.ref_cnt}")
        if block.ref_cnt == 0 and block.block_id not in seen:
            raise IntegrityError(f"block {block.block_id} has ref count 0 but is not free")
        if block.key is not None and self.cached.get(block.key) is not block:
            raise IntegrityError(f"block {block.block_id} has a key the cache map lacks")
    for key, block in self.cached.items():
        if block.key != key:
            raise IntegrityError(f"cache map names block {block.block_id} under a stale key")
    free, cached, referenced = self.counts()
    if free + cached + referenced != self.num_blocks:
        raise IntegrityError(
            f"free {free} + cached {cached} + referenced {referenced} != {self.num_blocks}"
        )
