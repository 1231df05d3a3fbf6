"""Where the pool's slots go: the numbers paging exists to improve.

Every slot of the pool falls in exactly one category (they sum to `total_slots`):
- token_state: holds a token's K/V now (a slot in a block shared by several sequences
  counts once);
- reserved: allocated to a sequence that will fill it before it finishes. Without a known
  `final_len`, every allocated-but-unfilled slot counts here;
- internal_fragmentation: allocated to a sequence that will never fill it (needs
  `final_len`; a shared block is filled as far as its furthest-reaching holder will go);
- external_fragmentation: free, but the next request cannot use it (contiguous policies:
  free blocks in free runs shorter than the next request's reservation; paged: always 0,
  any free block fits any sequence);
- free: free and usable. Prefix-cached blocks (ref count 0, keyed) are free: any
  allocation may evict them.
Swapped-out sequences hold no device slots and do not appear.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields

SLOT_FIELDS = ("token_state", "reserved", "internal_fragmentation", "external_fragmentation", "free")


@dataclass
class PoolSnapshot:
    """Slot counts (the first six fields) and block counts (the last four) of one pool."""

    token_state: int
    reserved: int
    internal_fragmentation: int
    external_fragmentation: int
    free: int
    total_slots: int
    num_blocks: int
    blocks_free: int
    blocks_cached: int
    blocks_referenced: int

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 0:
                raise ValueError(f"{f.name} must be >= 0, got {getattr(self, f.name)}")
        slots = sum(getattr(self, name) for name in SLOT_FIELDS)
        if slots != self.total_slots:
            raise ValueError(f"slot categories sum to {slots}, not total_slots={self.total_slots}")
        blocks = self.blocks_free + self.blocks_cached + self.blocks_referenced
        if blocks != self.num_blocks:
            raise ValueError(f"block counts sum to {blocks}, not num_blocks={self.num_blocks}")

    @property
    def token_state_fraction(self) -> float:
        """Fraction of the pool's slots holding token state."""
        return self.token_state / self.total_slots if self.total_slots else 0.0

    def as_dict(self) -> dict[str, float]:
        d: dict[str, float] = asdict(self)
        d["token_state_fraction"] = self.token_state_fraction
        return d


def split_allocation(capacity: int, filled: int, final_len: int | None) -> tuple[int, int, int]:
    """(token_state, reserved, internal) of `capacity` allocated slots holding `filled`
    tokens, for a sequence that ends at `final_len` tokens (None: unknown, all reserved)."""
    filled = max(min(filled, capacity), 0)
    will_fill = capacity if final_len is None else max(min(final_len, capacity), filled)
    return filled, will_fill - filled, capacity - will_fill


def paged_snapshot(
    *,
    block_size: int,
    num_blocks: int,
    holders: Iterable[tuple[list[int], int, int | None]],
    blocks_free: int,
    blocks_cached: int,
) -> PoolSnapshot:
    """`holders`: (block ids, num_tokens, final_len) of each sequence on the device; a None
    id is a block freed because it left every layer's sliding window."""
    filled: dict[int, int] = {}
    target: dict[int, int] = {}
    for block_ids, num_tokens, final_len in holders:
        for i, b in enumerate(block_ids):
            if b is None:
                continue
            start = i * block_size
            end = None if final_len is None else final_len - start
            f, r, _ = split_allocation(block_size, num_tokens - start, end)
            filled[b] = max(filled.get(b, 0), f)
            target[b] = max(target.get(b, 0), f + r)
    referenced = len(filled)
    token_state = sum(filled.values())
    reserved = sum(target[b] - filled[b] for b in filled)
    internal = referenced * block_size - token_state - reserved
    if blocks_free + blocks_cached + referenced != num_blocks:
        raise ValueError(
            f"free {blocks_free} + cached {blocks_cached} + referenced {referenced}"
            f" != {num_blocks} blocks"
        )
    return PoolSnapshot(
        token_state=token_state,
        reserved=reserved,
        internal_fragmentation=internal,
        external_fragmentation=0,
        free=(blocks_free + blocks_cached) * block_size,
        total_slots=num_blocks * block_size,
        num_blocks=num_blocks,
        blocks_free=blocks_free,
        blocks_cached=blocks_cached,
        blocks_referenced=referenced,
    )


def contiguous_snapshot(
    *,
    block_size: int,
    num_blocks: int,
    runs: Iterable[tuple[int, int, int | None]],
    free_runs: Iterable[int],
    next_request_blocks: int,
) -> PoolSnapshot:
    """`runs`: (reserved blocks, num_tokens, final_len) per sequence; `free_runs`: the
    lengths of the free runs. Free runs shorter than `next_request_blocks` are external
    fragmentation."""
    token_state = reserved = internal = referenced = 0
    for nblocks, num_tokens, final_len in runs:
        f, r, i = split_allocation(nblocks * block_size, num_tokens, final_len)
        token_state, reserved, internal = token_state + f, reserved + r, internal + i
        referenced += nblocks
    free_runs = list(free_runs)
    unusable = sum(n for n in free_runs if n < next_request_blocks)
    blocks_free = sum(free_runs)
    return PoolSnapshot(
        token_state=token_state,
        reserved=reserved,
        internal_fragmentation=internal,
        external_fragmentation=unusable * block_size,
        free=(blocks_free - unusable) * block_size,
        total_slots=num_blocks * block_size,
        num_blocks=num_blocks,
        blocks_free=blocks_free,
        blocks_cached=0,
        blocks_referenced=referenced,
    )
