"""The prefix cache's host tier: evicted cached blocks kept in host memory, by block key.

Bookkeeping only (the bytes live in pagedserve.memsvc.host_pool's tensor; the allocator returns the
copies). Each entry maps a block key (pagedserve.wire.block_keys: chained over the salt and every
token before it) to one host block and the salt it was stored under; `lookup` with another
salt misses, so a host block is never handed to a tenant with a different salt even if two
keys collided. Entries are evicted least recently used first (an OrderedDict: a hit or a
store moves the key to the end). An entry being restored is `pin`ned for the act that
restores it: no store in that act may reuse its host block before the restore copy is
recorded. Capacity 0 stores nothing.

The tier is a cache: losing it (memsvc restarts) loses nothing but hits. Design and the
ordering rules: docs/ARCHITECTURE.md, "Prefix cache, sharing and preemption".
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from pagedserve.memsvc.block_pool import IntegrityError


@dataclass(slots=True)
class HostEntry:
    host_block: int
    salt: str | None


@dataclass
class HostTierStats:
    """Counters in blocks: `lookups` keys looked up past the pool's hits, `hits` of them
    found; `offloaded` stores (copies out), `restored` copies in, `dropped` evictions from
    the pool not stored (not worth it, tier full of pinned entries, or content not final
    yet), `evicted` entries the tier itself dropped (LRU)."""

    lookups: int = 0
    hits: int = 0
    offloaded: int = 0
    restored: int = 0
    dropped: int = 0
    evicted: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0


class HostTier:
    """`num_blocks` host blocks of prefix cache (0: the tier is off)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"kv offload blocks must be >= 0, got {num_blocks}; "
                             "size the tier with --kv-offload GIB (0 turns it off)")
        self.num_blocks = num_blocks
        self.entries: OrderedDict[bytes, HostEntry] = OrderedDict()
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives 0, 1, ...
        self._pinned: set[bytes] = set()
        self.stats = HostTierStats()

    @property
    def num_used(self) -> int:
        return len(self.entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self.entries

    def lookup(self, key: bytes, salt: str | None) -> HostEntry | None:
        """The entry for `key` stored under `salt` (None otherwise); counts the lookup."""
        self.stats.lookups += 1
        entry = self.entries.get(key)
        if entry is None or entry.salt != salt:
            return None
        self.stats.hits += 1
        return entry

    def peek(self, key: bytes, salt: str | None) -> HostEntry | None:
        """`lookup` without counting or touching (admission checks)."""
        entry = self.entries.get(key)
        return entry if entry is not None and entry.salt == salt else None

    def pin(self, keys: list[bytes]) -> None:
        self._pinned.update(keys)

    def unpin(self, keys: list[bytes]) -> None:
        self._pinned.difference_update(keys)

    def restored(self, key: bytes) -> int:
        """A hit is being copied in: the entry becomes most recent; its host block."""
        self.entries.move_to_end(key)
        self.stats.restored += 1
        return self.entries[key].host_block

    def store(self, key: bytes, salt: str | None) -> int | None:
        """A host block to copy an evicted pool block into, evicting the least recently used
        unpinned entry when full; None when `key` is already held (it is touched) or
        nothing can be evicted."""
        if key in self.entries:
            self.entries.move_to_end(key)
            return None
        if not self._free:
            victim = next((k for k in self.entries if k not in self._pinned), None)
            if victim is None:
                self.stats.dropped += 1
                return None
            self._free.append(self.entries.pop(victim).host_block)
            self.stats.evicted += 1
        host_block = self._free.pop()
        self.entries[key] = HostEntry(host_block, salt)
        self.stats.offloaded += 1
        return host_block

    def clear(self) -> None:
        """Forget every entry (the host memory is gone or no longer trusted)."""
        self.entries.clear()
        self._pinned.clear()
        self._free = list(range(self.num_blocks - 1, -1, -1))

    def check(self) -> None:
        """Entries and the free list partition the host blocks; nothing stays pinned
        between acts. IntegrityError naming what is wrong."""
        used = [e.host_block for e in self.entries.values()]
        if len(set(used)) != len(used):
            raise IntegrityError(f"host tier: a host block backs two keys ({sorted(used)})")
        free = set(self._free)
        if len(free) != len(self._free) or free & set(used):
            raise IntegrityError("host tier: the free list repeats a block or holds one in use")
        if len(free) + len(used) != self.num_blocks or any(not 0 <= b < self.num_blocks for b in free | set(used)):
            raise IntegrityError(f"host tier: {len(free)} free + {len(used)} used != {self.num_blocks} "
                                 "host blocks")
        if self._pinned:
            raise IntegrityError(f"host tier: {len(self._pinned)} entries left pinned after an act")
