"""memsvc holds the block tables of record (the gateway holds none): `tables` answers a
session's running tables whole, to resend an executor that lost its state, and a forked
sequence's first grant carries its whole table."""
from pagedserve.memsvc.memory_manager import MemoryConfig, MemoryManager
from pagedserve.wire.protocol import KVGeometry
from pagedserve.wire.reserve_messages import Plan, PlanEntry

BS = 4


def manager():
    mem = MemoryManager(MemoryConfig(num_blocks=32, prefix_caching=False))
    mem.register_executor(KVGeometry(1, 1, 1, BS))
    return mem


def test_tables_are_memsvcs_in_the_sessions_namespace():
    mem = manager()
    first = mem.reserve(Plan([PlanEntry("a", list(range(10)), True, 64, max_new_tokens=10)]), "s")
    (grant,) = first.grants
    assert mem.tables(["a", "gone"], "s") == [grant.new_blocks, []]
    assert mem.tables(["a"], "other") == [[]]  # another session's "a" is not this one
    mem.reserve(Plan([PlanEntry("a", [10, 11, 12], False, 64)]), "s")
    assert mem.tables(["a"], "s") == [mem.allocator.block_table("s|a")] and len(mem.tables(["a"], "s")[0]) == 4


def test_a_forked_sequences_first_grant_carries_its_whole_table():
    mem = manager()
    mem.reserve(Plan([PlanEntry("p", list(range(6)), True, 64, max_new_tokens=6)]), "s")
    mem.fork("p", "c", "s")
    r = mem.reserve(Plan([PlanEntry("p", [6], False, 64), PlanEntry("c", [7], False, 64)]), "s")
    parent, child = r.grants
    assert (parent.table_start, parent.new_blocks) == (1, [parent.new_blocks[0]])  # its copy on write
    assert child.table_start == 0 and child.new_blocks == mem.tables(["c"], "s")[0]
    assert len(child.new_blocks) == 2 and child.new_blocks[0] == mem.tables(["p"], "s")[0][0]  # shared
