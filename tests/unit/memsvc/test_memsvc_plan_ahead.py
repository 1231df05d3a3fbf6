"""Plans made ahead (Plan.ahead): pending tokens, fills, and the deferral that keeps memsvc
from touching blocks the running step uses (no copies, no preemption)."""
import pytest

from pagedserve.memsvc import PagedAllocator
from pagedserve.memsvc.memory_manager import MemoryConfig, MemoryManager
from pagedserve.wire import step_convert
from pagedserve.wire.pending_token import PENDING
from pagedserve.wire.protocol import KVGeometry
from pagedserve.wire.reserve_messages import Plan, PlanEntry
from tests.support.written import ran

BS = 4


def manager(num_blocks=16, **kw):
    mem = MemoryManager(MemoryConfig(num_blocks=num_blocks, **kw))
    mem.register_executor(KVGeometry(1, 1, 1, BS))
    return mem


def new(seq_id, prompt, max_len=64):
    return PlanEntry(seq_id, list(prompt), True, max_len, max_new_tokens=len(prompt))


def decode(seq_id, tokens=(), pending=False, max_len=64):
    return PlanEntry(seq_id, list(tokens) + [PENDING] * pending, False, max_len)


def test_a_block_completed_by_a_pending_token_is_keyed_once_it_is_filled():
    a = PagedAllocator(8, BS)
    a.add_sequence("a", [1, 2, 3], max_len=16)
    a.append("a", [1, 2, 3, PENDING])  # the block is full, its last id unknown
    assert a._seqs["a"].block_keys == []
    a.check_integrity()
    a.append("a", [PENDING])  # (the fill of the first comes later than the second here)
    a.check_integrity()
    a.fill("a", 3, 9)
    assert len(a._seqs["a"].block_keys) == 1
    a.fill("a", 4, 10)
    a.check_integrity()
    ran(a)
    a.free("a")
    assert a.add_sequence("b", [1, 2, 3, 9, 10, 11], max_len=16) == 4  # the filled block is a hit
    with pytest.raises(ValueError, match="no pending token at position 5"):
        a.fill("b", 5, 1)


def test_a_fill_while_swapped_out_keys_the_block_at_the_swap_in():
    a = PagedAllocator(8, BS, num_host_blocks=4)
    a.add_sequence("a", [1, 2, 3], max_len=16)
    a.append("a", [1, 2, 3, PENDING])
    a.swap_out("a")
    a.fill("a", 3, 9)  # the block is not on the device: nothing is keyed yet
    assert a._seqs["a"].block_keys == []
    a.check_integrity()
    a.swap_in("a")
    assert len(a._seqs["a"].block_keys) == 1
    a.check_integrity()


def test_a_plan_made_ahead_is_granted_with_its_pending_token_and_filled_by_the_next():
    mem = manager()
    r = mem.reserve(Plan([new("s", [1, 2, 3])]))
    assert r.grants[0].num_tokens == 3
    r = mem.reserve(Plan([decode("s", pending=True), new("t", [5, 6])], ahead=True))
    assert not r.deferred
    assert [(g.seq_id, g.start_pos, g.num_tokens) for g in r.grants] == [("s", 3, 1), ("t", 0, 2)]
    r = mem.reserve(Plan([decode("s", pending=True)], ahead=True, fills=[("s", 3, 4)]))
    assert r.grants[0].start_pos == 4
    mem.check_integrity()
    assert len(mem.allocator._seqs["s"].block_keys) == 1  # [1, 2, 3, 4] keyed by the fill


def test_a_plan_made_ahead_is_deferred_rather_than_copy_or_preempt():
    mem = manager(num_blocks=3, watermark=0)
    mem.reserve(Plan([new("s", [1, 2, 3], max_len=12)]))
    mem.reserve(Plan([decode("s", [4])], forks=[("s", "c")]))  # s copies the shared block
    mem.reserve(Plan([decode("s", [5]), decode("c", [5])]))  # s takes the third block
    mem.reserve(Plan([decode("s", [6, 7, 8])]))
    assert mem.allocator.num_free_blocks() == 0  # the next token of s needs a block: none is free
    before = mem.stats().snapshot
    r = mem.reserve(Plan([decode("s", pending=True), decode("c", pending=True)], ahead=True))
    assert r.deferred and not r.grants and not r.preempted
    assert mem.stats().snapshot == before and mem.allocator.num_tokens("c") == 4
    # the frees of a deferred plan happen
    r = mem.reserve(Plan([decode("s", pending=True)], free=["c"], ahead=True))
    assert not r.deferred and mem.allocator.num_tokens("s") == 9
    mem.check_integrity()


def test_copy_on_write_defers_a_plan_made_ahead():
    mem = manager()
    mem.reserve(Plan([new("s", [1, 2, 3])]))
    mem.reserve(Plan([], forks=[("s", "c")]))  # both share the partial last block
    r = mem.reserve(Plan([decode("s", pending=True)], ahead=True))
    assert r.deferred
    r = mem.reserve(Plan([decode("s", [4])]))  # serially: the copy is made
    assert not r.deferred and r.grants[0].new_blocks
    mem.check_integrity()


def test_an_unknown_or_swapped_sequence_defers_and_bad_plans_are_refused():
    mem = manager(num_host_blocks=8, preemption_mode="swap")
    mem.reserve(Plan([new("s", [1, 2, 3])]))
    assert mem.reserve(Plan([decode("gone", pending=True)], ahead=True)).deferred
    assert mem.reserve(Plan([decode("gone", pending=True)], ahead=True), session_id="g").deferred
    with pytest.raises(ValueError, match="cannot fork"):
        mem.reserve(Plan([], forks=[("s", "c")], ahead=True))
    with pytest.raises(ValueError, match="pending token"):
        mem.reserve(Plan([decode("s", pending=True)]))
    with pytest.raises(ValueError, match="pending token"):
        mem.reserve(Plan([PlanEntry("n", [1, PENDING], True, 8)], ahead=True))
    mem.allocator.swap_out("s")
    assert mem.reserve(Plan([decode("s", pending=True)], ahead=True)).deferred


def test_ahead_fields_cross_the_wire():
    plan = Plan([decode("s", [7], pending=True)], free=["x"], ahead=True, fills=[("s", 3, 9)])
    back = step_convert.plan_from_proto(step_convert.plan_to_proto(plan, "g"))
    assert back.ahead and list(back.fills) == [("s", 3, 9)] and back.run_tokens == [7, PENDING]
    mem = manager()
    mem.reserve(Plan([new("s", [1, 2, 3])]))
    r = mem.reserve(Plan([decode("s", pending=True)], ahead=True))
    assert step_convert.reserve_result_from_proto(step_convert.reserve_result_to_proto(r)) == r
    deferred = mem.reserve(Plan([decode("nope", pending=True)], ahead=True))
    assert step_convert.reserve_result_from_proto(step_convert.reserve_result_to_proto(deferred)).deferred


def test_fills_are_read_in_the_sessions_namespace():
    mem = manager()
    for session in ("g1", "g2"):  # the same sequence id in two sessions
        mem.reserve(Plan([new("s", [1, 2, 3])]), session_id=session)
        r = mem.reserve(Plan([decode("s", pending=True)], ahead=True), session_id=session)
        assert not r.deferred and r.grants[0].seq_id == "s"
    mem.reserve(Plan([decode("s", [5])], fills=[("s", 3, 4)]), session_id="g1")
    tables = mem.allocator._seqs
    assert len(tables["g1|s"].block_keys) == 1 and tables["g2|s"].block_keys == []
    mem.check_integrity()
