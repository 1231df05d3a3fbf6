"""pagedserve.memsvc.block_watch: a snapshot of the cached block keys, then only the changes."""
from types import SimpleNamespace

from pagedserve.memsvc.block_watch import BlockWatch


def test_block_watch_sends_a_snapshot_then_changes():
    pool = SimpleNamespace(cached={b"k1": 1, b"k2": 2})
    allocator = SimpleNamespace(pool=pool, num_free_blocks=lambda: 5, sequence_ids=lambda: ["s"])
    manager = SimpleNamespace(allocator=allocator, geometry=SimpleNamespace(block_size=16),
                              pool=SimpleNamespace(shape=(8,)))
    watch = BlockWatch()
    first = watch.next_events(manager, "epoch")
    assert first.snapshot and set(first.stored) == {b"k1", b"k2"} and first.num_blocks == 8
    del pool.cached[b"k1"]
    pool.cached[b"k3"] = 3
    second = watch.next_events(manager, "epoch")
    assert not second.snapshot and list(second.stored) == [b"k3"] and list(second.evicted) == [b"k1"]
