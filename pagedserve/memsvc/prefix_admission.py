"""A new sequence in a PagedAllocator: `admit` (the check) and `add_sequence` (the act),
both over the longest run of its prompt's full blocks already cached.

The prefix walk takes pool hits, then, where restoring is allowed, host-tier hits
(pagedserve.memsvc.prefix_offload) that get fresh pool blocks and restore copies; it never
takes the block of the prompt's last token, which is always computed. `admit` is pure: it
changes nothing and counts no lookups; `add_sequence` attaches the hits (where the pool
cannot give the restored ones fresh blocks, the prefix ends at the first host hit) and
counts the lookups. docs/ARCHITECTURE.md, "Prefix cache, sharing and preemption".
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from pagedserve.memsvc.admission import Admission, check_request, paged_admission
from pagedserve.memsvc.block_pool import Block, NoFreeBlocks
from pagedserve.memsvc.block_table import BlockTable
from pagedserve.memsvc.host_tier import HostEntry
from pagedserve.memsvc.prefix_cache import cacheable_blocks

if TYPE_CHECKING:
    from pagedserve.memsvc.paged_allocator import PagedAllocator


def admit(alloc: PagedAllocator, prompt_token_ids: list[int], max_len: int, salt: str | None,
          use_cache: bool) -> Admission:
    cached, _ = cached_prefix(alloc, prompt_token_ids, salt) if use_cache else ([], [])
    revived = sum(1 for b in cached if isinstance(b, Block) and b.ref_cnt == 0)  # leave the queue
    restored = sum(1 for b in cached if not isinstance(b, Block))  # take fresh blocks
    return paged_admission(
        prompt_len=len(prompt_token_ids),
        max_len=max_len,
        block_size=alloc.block_size,
        num_blocks=alloc.num_blocks,
        cached_blocks=len(cached),
        free_blocks=alloc.pool.num_free - revived - restored,
    )


def add_sequence(alloc: PagedAllocator, seq_id: str, prompt_token_ids: list[int], *, max_len: int,
                 final_len: int | None, salt: str | None, use_cache: bool) -> int:
    if seq_id in alloc._seqs:
        raise ValueError(f"sequence {seq_id!r} is already registered")
    check_request(len(prompt_token_ids), max_len)
    table = BlockTable(seq_id, alloc.block_size, max_len, final_len, salt)
    hits, keys = cached_prefix(alloc, prompt_token_ids, salt, count=True) if use_cache else ([], [])
    cached = _attach(alloc, hits, keys, salt)
    table.blocks, table.block_keys = cached, keys[:len(cached)]
    table.num_tokens, table.written = len(cached) * alloc.block_size, len(cached)
    if alloc.enable_prefix_caching and use_cache:
        alloc.prefix_stats.record(len(prompt_token_ids), table.num_tokens)
    alloc._seqs[seq_id] = table
    return table.num_tokens


def cached_prefix(alloc: PagedAllocator, prompt: list[int], salt: str | None, *, count: bool = False
                  ) -> tuple[list[Block | HostEntry], list[bytes]]:
    """The longest run of cached full prompt blocks (never the block of the last token):
    pool blocks, and past them host-tier entries where restoring is allowed (`count`:
    the tier counts the lookups)."""
    hits: list[Block | HostEntry] = []
    keys: list[bytes] = []
    if not alloc.enable_prefix_caching:
        return hits, keys
    tier = alloc.offload.tier if alloc.offload and alloc.offload.restore_allowed else None
    walk = alloc.prompt_keys
    walk.start(prompt, salt)
    for i in range(cacheable_blocks(len(prompt), alloc.block_size)):
        parent = walk.block(i)
        hit = alloc.pool.lookup(parent)
        if hit is None and tier is not None:
            hit = tier.lookup(parent, salt) if count else tier.peek(parent, salt)
        if hit is None:
            break
        hits.append(hit)
        keys.append(parent)
    return hits, keys


def _attach(alloc: PagedAllocator, hits: list[Block | HostEntry], keys: list[bytes],
            salt: str | None) -> list[Block]:
    """Take the pool hits, then fresh blocks for the host hits (restored; where the pool
    cannot give them, the prefix ends at the first host hit)."""
    if not hits:
        return []
    pool_hits = [b for b in hits if isinstance(b, Block)]
    alloc.pool.incref(pool_hits)  # a hit takes the block out of the free queue: it is in use
    host = [i for i, b in enumerate(hits) if not isinstance(b, Block)]
    if not host:
        return pool_hits
    host_keys = [keys[i] for i in host]
    alloc.offload.tier.pin(host_keys)
    try:
        fresh = alloc.pool.allocate(len(host))
    except NoFreeBlocks:
        alloc.pool.free(reversed(pool_hits[host[0]:]))
        return pool_hits[:host[0]]
    finally:
        alloc.offload.tier.unpin(host_keys)
    alloc.offload.restore(host_keys, salt, fresh)
    it = iter(fresh)
    return [b if isinstance(b, Block) else next(it) for b in hits]
