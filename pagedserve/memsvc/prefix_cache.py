"""Prefix-cache statistics; the block keys themselves live in pagedserve.wire.block_keys (the
gateway computes the same keys to route by prefix affinity), re-exported here."""
from __future__ import annotations

from dataclasses import dataclass

from pagedserve.wire.block_keys import (
    KEY_BYTES,
    block_key,
    cacheable_blocks,
    prompt_block_keys,
)

__all__ = ["KEY_BYTES", "block_key", "cacheable_blocks", "prompt_block_keys", "PrefixCacheStats"]


@dataclass
class PrefixCacheStats:
    """Token counters: `queries` prompt tokens looked up, `hits` of them found cached."""

    queries: int = 0
    hits: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.hits <= self.queries:
            raise ValueError(f"need 0 <= hits <= queries, got {self.hits} > {self.queries}")

    def record(self, queried: int, hit: int) -> None:
        self.queries += queried
        self.hits += hit

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0
