"""What memsvc tells gateways about the blocks it holds, for prefix-aware routing.

`BlockWatch` is the WatchBlocks stream's state for one watcher: `next_events(manager)`
diffs the prefix-cache keys held now against those sent last, so the first message is a
snapshot and each later one carries only what was stored and evicted. The keys are those
of pagedserve.wire.block_keys (chained over the prompt's full blocks), so a gateway computes
the same keys for a new prompt and counts the leading blocks a pool already holds.

`BlockChanges` wakes watchers when a Reserve or Free may have changed the keys (a
condition variable; watchers also wake every interval to report the pool's load).
Called with memsvc's lock held for the diff; waiting happens outside it.
"""
from __future__ import annotations

import threading

from pagedserve.wire.v1 import memory_pb2


def held_keys(manager) -> set[bytes]:
    """Keys of the blocks the pool holds (cached or in use); none for non-paged policies."""
    pool = getattr(manager.allocator, "pool", None)
    cached = getattr(pool, "cached", None)
    return set(cached) if cached is not None else set()


class BlockChanges:
    def __init__(self):
        self._cond = threading.Condition()
        self._version = 0

    def notify(self) -> None:
        with self._cond:
            self._version += 1
            self._cond.notify_all()

    def wait(self, seen: int, timeout: float) -> int:
        """Return the version once it is past `seen`, or after `timeout` seconds."""
        with self._cond:
            self._cond.wait_for(lambda: self._version != seen, timeout)
            return self._version


class BlockWatch:
    def __init__(self):
        self.sent: set[bytes] | None = None

    def next_events(self, manager, pool_id: str) -> memory_pb2.BlockEvents:
        """The next message: keys stored and evicted since the last one, and the pool's load."""
        keys = held_keys(manager)
        allocator = manager.allocator
        events = memory_pb2.BlockEvents(
            block_size=manager.geometry.block_size, num_blocks=manager.pool.shape[0],
            blocks_free=allocator.num_free_blocks(), num_sequences=len(allocator.sequence_ids()),
            pool_id=pool_id)
        if self.sent is None:
            events.snapshot = True
            events.stored.extend(sorted(keys))
        else:
            events.stored.extend(sorted(keys - self.sent))
            events.evicted.extend(sorted(self.sent - keys))
        self.sent = keys
        return events
