"""The paged allocator's link to the host tier: which evicted blocks are offloaded, which
prefix hits are restored, and the copies that make both true, in the order decided.

- Offload: a cached block (ref count 0, keyed) that an allocation evicts is stored in the
  host tier when `pays()` (the cost model: a copy out and back is cheaper than computing
  the block's tokens again) and its contents are final. A block keyed in the current act
  (`stamp`), or in an act whose step may still be running (`unsafe`: the stamp of each
  gateway session's last Reserve when that step may be in flight), may hold K/V not
  written yet: it is dropped, as without the tier. The copy ("offload", pool block, host
  block) is recorded at the eviction, so it precedes every copy or write into the block
  by its new holder.
- Restore: a new sequence's prefix walk goes on past the pool's hits into the tier; the
  hits get fresh pool blocks and ("restore", host block, pool block) copies, recorded
  after the evictions that freed those blocks. Restoring is off (`restore_allowed`) for a
  plan made ahead: the step in flight may still write a block just freed.
- `take()`: the copies recorded since the last take, in order; memsvc performs them before
  Reserve answers, as it does swap-ins.
See docs/ARCHITECTURE.md, "Prefix cache, sharing and preemption".
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

from pagedserve.memsvc.block_pool import Block, BlockPool
from pagedserve.memsvc.host_tier import HostTier

OFFLOAD, RESTORE = "offload", "restore"


class PrefixOffload:
    def __init__(self, pool: BlockPool, tier: HostTier, block_size: int,
                 pays: Callable[[], bool] = lambda: True) -> None:
        self.pool, self.tier, self.block_size, self.pays = pool, tier, block_size, pays
        self.unsafe: frozenset[int] = frozenset()
        self.restore_allowed = True
        self.tokens_restored = 0  # prompt tokens not recomputed thanks to the tier
        self._copies: list[tuple[str, int, int]] = []
        pool.on_evict = self._evicted

    def begin(self, unsafe: Iterable[int] = (), *, restore_allowed: bool = True) -> int:
        """A new act (one Reserve): a new stamp; `unsafe` stamps whose blocks may not be
        final. Returns the stamp."""
        self.pool.stamp += 1
        self.unsafe = frozenset(unsafe)
        self.restore_allowed = restore_allowed
        return self.pool.stamp

    def _evicted(self, block: Block) -> None:
        stats = self.tier.stats
        if (self.tier.num_blocks == 0 or block.keyed_at == self.pool.stamp
                or block.keyed_at in self.unsafe or not self.pays()):
            if block.key not in self.tier:
                stats.dropped += 1
            return
        host = self.tier.store(block.key, block.salt)
        if host is not None:
            self._copies.append((OFFLOAD, block.block_id, host))

    def restore(self, keys: list[bytes], salt: str | None, blocks: list[Block]) -> None:
        """`blocks` (just allocated) now hold the tier's entries for `keys`."""
        for key, block in zip(keys, blocks):
            self.pool.cache(block, key, salt)
            self._copies.append((RESTORE, self.tier.restored(key), block.block_id))
        self.tokens_restored += len(keys) * self.block_size

    def take(self) -> list[tuple[str, int, int]]:
        out, self._copies = self._copies, []
        return out
