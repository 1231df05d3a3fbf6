"""The paged allocator's integrity check: every block's reference count equals the tables
that hold it, no table holds a block of another pool, every table is consistent with its
keys, a sequence sharing its partial last block is in `shared_tails`, and the swap space
and host tier agree with what the tables hold. Raises IntegrityError. See
docs/ARCHITECTURE.md, "Allocation: check, then act".
"""
from __future__ import annotations

from pagedserve.memsvc.block_pool import IntegrityError


def check_paged_integrity(alloc) -> None:
    alloc.pool.check()
    holders: dict[int, list[str]] = {}
    host_held: list[int] = []
    for t in alloc._seqs.values():
        t.check(keyed=alloc.enable_prefix_caching)
        host_held.extend(t.host_blocks)
        for b in t.live_blocks:
            if alloc.pool.blocks[b.block_id] is not b:
                raise IntegrityError(f"sequence {t.seq_id!r} holds a foreign block {b.block_id}")
            holders.setdefault(b.block_id, []).append(t.seq_id)
    for block in alloc.pool.blocks:
        names = holders.get(block.block_id, [])
        if block.ref_cnt != len(names):
            raise IntegrityError(
                f"block {block.block_id} has ref count {block.ref_cnt} but"
                f" {len(names)} block tables hold it {names}"
            )
    for t in alloc._seqs.values():
        if not t.swapped and alloc._needs_cow(t, 1) and t.seq_id not in alloc.shared_tails:
            raise IntegrityError(f"sequence {t.seq_id!r} shares its partial last block "
                                 f"{t.blocks[-1].block_id} but is not in shared_tails")
    alloc.swap_space.check(host_held)
    if alloc.offload is not None:
        alloc.offload.tier.check()
