"""memsvc's stats: the pool's snapshot, the prefix cache, preemptions (swap and recompute,
the host swap space, the measured costs) and the prefix cache's host tier, read from the
manager's allocator and planner. They change nothing. Exported as Prometheus metrics by
pagedserve.memsvc.metrics; docs/ARCHITECTURE.md, "Prefix cache, sharing and preemption".
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from pagedserve.wire.protocol import PoolStats

if TYPE_CHECKING:
    from pagedserve.memsvc.memory_manager import MemoryManager

HOST_TIER_FIELDS = ("host_tier_blocks", "host_tier_blocks_used", "host_tier_lookups", "host_tier_hits",
                    "host_tier_hit_rate", "host_tier_offloaded", "host_tier_restored",
                    "host_tier_dropped", "host_tier_evicted", "host_tier_tokens_restored")


def stats(mm: MemoryManager) -> PoolStats:
    mm._planner()
    alloc = mm.allocator
    return PoolStats(
        snapshot=alloc.snapshot().as_dict(),
        prefix_cache_queries=getattr(alloc, "prefix_cache_queries", 0),
        prefix_cache_hits=getattr(alloc, "prefix_cache_hits", 0),
        num_preemptions=mm.num_preemptions,
        num_sequences=len(alloc.sequence_ids()) if hasattr(alloc, "sequence_ids") else 0,
        num_sessions=len(mm.sessions.by_id),
        preemption=preemption_stats(mm),
    )


def preemption_stats(mm: MemoryManager) -> dict:
    counts, costs = mm._planner().counts, mm.policy.costs
    swap = getattr(mm.allocator, "swap_space", None)
    return {
        "preemption_mode": mm.policy.mode,
        "num_swapped_out": counts.swapped_out, "num_swapped_in": counts.swapped_in,
        "num_recomputed": counts.recomputed, "num_swap_fallbacks": counts.swap_fallbacks,
        "host_blocks": swap.num_blocks if swap else 0,
        "host_blocks_free": swap.num_free if swap else 0,
        "swap_seconds_per_block": costs.seconds_per_block or 0.0,
        "recompute_seconds_per_token": costs.seconds_per_token or 0.0,
        **host_tier_stats(mm),
    }


def host_tier_stats(mm: MemoryManager) -> dict:
    """The prefix cache's host tier (zeros when off): occupancy in blocks, its hit rate
    over the blocks looked up past the pool's hits, blocks offloaded / restored /
    dropped / evicted, and prompt tokens not recomputed thanks to it."""
    offload = getattr(mm.allocator, "offload", None)
    if offload is None:
        return dict.fromkeys(HOST_TIER_FIELDS, 0)
    tier, s = offload.tier, offload.tier.stats
    return {"host_tier_blocks": tier.num_blocks, "host_tier_blocks_used": tier.num_used,
            "host_tier_lookups": s.lookups, "host_tier_hits": s.hits,
            "host_tier_hit_rate": s.hit_rate, "host_tier_offloaded": s.offloaded,
            "host_tier_restored": s.restored, "host_tier_dropped": s.dropped,
            "host_tier_evicted": s.evicted, "host_tier_tokens_restored": offload.tokens_restored}
