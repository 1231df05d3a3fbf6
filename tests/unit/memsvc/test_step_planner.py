"""pagedserve.memsvc.step_planner with hand-made plans over a paged allocator: grants in plan order,
preemption from the tail by recompute or swap, resumption before admission with no
overtaking, the watermark, plans made ahead granted only without copies or preemption, and
the plan checks. Every case ends with the pool's integrity checked."""
import pytest

from pagedserve.memsvc.paged_allocator import PagedAllocator
from pagedserve.memsvc.preemption_policy import PreemptionPolicy
from pagedserve.memsvc.step_planner import StepPlanner, check_plan
from pagedserve.wire.pending_token import PENDING
from pagedserve.wire.reserve_messages import Plan, PlanEntry

BS = 4


def new(seq_id, n, max_len=16, pending=False, **kw):
    tokens = list(range(100 * len(seq_id), 100 * len(seq_id) + n)) + [PENDING] * pending
    return PlanEntry(seq_id, tokens, True, max_len, **kw)


def run(seq_id, n=1, pending=False):
    return PlanEntry(seq_id, [7] * n + [PENDING] * pending, False, 64)


def planner(num_blocks, mode="recompute", host=0, watermark=0):
    a = PagedAllocator(num_blocks, BS, enable_prefix_caching=False, num_host_blocks=host)
    return a, StepPlanner(a, PreemptionPolicy(mode), watermark_blocks=watermark)


def grants(reservation):
    return [(g.seq_id, g.start_pos, g.num_tokens) for g in reservation.result.grants]


def test_new_sequences_are_granted_in_plan_order_then_decode():
    a, p = planner(8)
    assert grants(p.reserve(Plan([new("a", 6), new("bb", 3)]))) == [("a", 0, 6), ("bb", 0, 3)]
    assert grants(p.reserve(Plan([run("a"), run("bb")]))) == [("a", 6, 1), ("bb", 3, 1)]
    assert len(a.block_table("a")) == 2 and len(a.block_table("bb")) == 1
    a.check_integrity()


def test_a_running_sequence_that_cannot_grow_preempts_the_tail_by_recompute():
    a, p = planner(4)
    p.reserve(Plan([new("a", 8), new("bb", 8)]))  # both full: 2 blocks each, none free
    r = p.reserve(Plan([run("a"), run("bb")]))
    assert [(x.seq_id, x.mode) for x in r.result.preempted] == [("bb", "recompute")]
    assert grants(r) == [("a", 8, 1)] and not a.has_sequence("bb")
    assert p.counts.recomputed == 1
    a.check_integrity()


def test_the_asking_sequence_is_preempted_when_it_is_the_last():
    a, p = planner(4)
    p.reserve(Plan([new("a", 8), new("bb", 8)]))
    r = p.reserve(Plan([run("bb"), run("a")]))  # bb first in priority now: a is the tail
    assert [x.seq_id for x in r.result.preempted] == ["a"] and grants(r) == [("bb", 8, 1)]
    a.check_integrity()


def test_swap_out_then_resume_before_any_new_sequence():
    a, p = planner(4, mode="swap", host=8)
    p.reserve(Plan([new("a", 8), new("bb", 8)]))
    r = p.reserve(Plan([run("a"), run("bb")]))
    assert [(x.seq_id, x.mode) for x in r.result.preempted] == [("bb", "swap")]
    assert [k for k, _, _ in r.copies] == ["out", "out"]
    a.free("a")
    r = p.reserve(Plan([run("bb"), new("ccc", 4)]))
    assert r.result.resumed == ["bb"] and [k for k, _, _ in r.copies] == ["in", "in"]
    assert grants(r) == [("bb", 8, 1), ("ccc", 0, 4)]
    assert (p.counts.swapped_out, p.counts.swapped_in) == (1, 1)
    a.check_integrity()


def test_a_new_sequence_does_not_overtake_one_that_waits():
    a, p = planner(4)
    p.reserve(Plan([new("a", 12)]))  # 3 of 4 blocks
    r = p.reserve(Plan([run("a"), new("bb", 8), new("c", 2)]))
    assert grants(r) == [("a", 12, 1)] and r.result.waiting == ["bb", "c"]
    a.check_integrity()


def test_the_watermark_keeps_blocks_free_while_others_hold_blocks():
    a, p = planner(6, watermark=2)
    p.reserve(Plan([new("a", 4)]))  # 1 block held, 5 free
    r = p.reserve(Plan([run("a"), new("bb", 12)]))  # 3 blocks + 2 watermark > 5 - 1
    assert r.result.waiting == ["bb"] and not a.has_sequence("bb")
    a.check_integrity()


def test_a_sequence_longer_than_the_pool_is_rejected_not_waiting():
    a, p = planner(2)
    r = p.reserve(Plan([new("a", 12, max_len=40)]))
    assert [x.seq_id for x in r.result.rejected] == ["a"] and not r.result.grants
    a.check_integrity()


def test_a_plan_made_ahead_is_deferred_when_it_would_preempt():
    a, p = planner(4)
    p.reserve(Plan([new("a", 8), new("bb", 8)]))
    r = p.reserve(Plan([run("a", pending=True), run("bb", pending=True)], ahead=True))
    assert r.result.deferred and not r.result.grants and not r.result.preempted
    assert a.has_sequence("bb")
    a.check_integrity()


def test_a_plan_made_ahead_that_fits_is_granted_with_its_pending_token():
    a, p = planner(8)
    p.reserve(Plan([new("a", 6)]))
    r = p.reserve(Plan([run("a", pending=True)], ahead=True))
    assert not r.result.deferred and grants(r) == [("a", 6, 2)]
    a.check_integrity()


def test_plan_checks_name_what_is_wrong():
    with pytest.raises(ValueError, match="cannot fork"):
        check_plan(Plan([run("a")], forks=[("a", "b")], ahead=True))
    with pytest.raises(ValueError, match="pending token"):
        check_plan(Plan([run("a", pending=True)]))
    with pytest.raises(ValueError, match="pending token"):
        check_plan(Plan([new("a", 3, pending=True)], ahead=True))
