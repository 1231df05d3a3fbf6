"""Prefix caching in the PagedAllocator: hits, eviction order, salts, counters."""
from __future__ import annotations

from pagedserve.memsvc import PagedAllocator
from tests.support.written import ran

BS = 4
A = list(range(100, 109))  # 9 tokens: 2 full blocks + 1
B = list(range(200, 209))


def start(alloc, seq_id, prompt, **kw):
    cached = alloc.add_sequence(seq_id, prompt, max_len=len(prompt) + 8, **kw)
    alloc.append(seq_id, prompt[cached:])
    ran(alloc)
    return cached


def free_queue(alloc):
    return [b.block_id for b in alloc.pool.free_queue]


def test_a_prefix_hit_after_free():
    a = PagedAllocator(8, BS)
    assert start(a, "a", A) == 0
    assert a.block_table("a") == [0, 1, 2]
    a.free("a")
    assert a.num_free_blocks() == 8 and a.snapshot().blocks_cached == 2
    cached = a.add_sequence("b", A, max_len=20)
    assert cached == 8 and a.block_table("b") == [0, 1] and a.num_tokens("b") == 8
    assert a.num_free_blocks() == 6  # the two hits left the free queue
    r = a.append("b", A[8:])  # the first append starts right after the cached prefix
    assert len(r.slot_mapping) == 1 and a.num_tokens("b") == 9
    assert (a.prefix_cache_queries, a.prefix_cache_hits) == (18, 8)
    a.check_integrity()


def test_a_hit_on_blocks_in_use_shares_them():
    a = PagedAllocator(8, BS)
    start(a, "a", A)
    assert start(a, "b", A + [1, 2, 3]) == 8
    assert a.block_table("b")[:2] == a.block_table("a")[:2]
    assert [a.pool.blocks[i].ref_cnt for i in (0, 1, 2)] == [2, 2, 1]
    a.check_integrity()


def test_a_full_prompt_hit_still_computes_the_last_token():
    a = PagedAllocator(8, BS)
    prompt = list(range(8))  # exactly 2 full blocks
    start(a, "a", prompt)
    assert a.add_sequence("b", prompt, max_len=12) == 4  # floor((8 - 1) / 4) * 4
    assert a.num_new_blocks("b", 4) == 1
    assert len(a.append("b", prompt[4:]).slot_mapping) == 4
    start(a, "c", list(range(9)))  # 9 tokens: both full blocks hit, the 9th is computed
    assert a.num_tokens("c") == 9 and a.block_table("c")[:2] == [0, 1]
    assert a.add_sequence("d", [1], max_len=2) == 0  # a one-token prompt never hits


def test_a_partial_match_stops_at_the_first_differing_block():
    a = PagedAllocator(8, BS)
    start(a, "a", A)
    other = A[:4] + [0, 0, 0, 0, 0]  # block 0 equal, block 1 differs
    assert a.add_sequence("b", other, max_len=12) == 4
    later_equal = [0, 0, 0, 0] + A[4:]  # block 1 equal but block 0 differs: the chain breaks
    assert a.add_sequence("c", later_equal, max_len=12) == 0


def test_exact_eviction_order_lru_and_tail_before_head():
    a = PagedAllocator(6, BS)
    start(a, "a", A)  # blocks 0, 1 (keyed), 2 (partial)
    start(a, "b", B)  # blocks 3, 4 (keyed), 5 (partial)
    a.free("a")
    a.free("b")
    # keyless partial blocks first (5 freed last, at the very head), then a's (older) then
    # b's; within each sequence the tail block 1 (or 4) before the head block 0 (or 3)
    assert free_queue(a) == [5, 2, 1, 0, 4, 3]
    start(a, "x", [7] * 12)  # 3 blocks: evicts a's tail block 1, not block 0
    assert a.block_table("x") == [5, 2, 1]
    assert a.add_sequence("probe", A, max_len=12) == 4  # block 0 still cached, block 1 gone
    a.free("probe")
    assert free_queue(a) == [4, 3, 0]  # probe's hit made block 0 the most recently used
    start(a, "y", [8] * 4)
    assert a.block_table("y") == [4]  # b's tail block goes before b's head block
    assert a.add_sequence("probe_b", B, max_len=12) == 4  # b's head block 3 still hits
    a.check_integrity()


def test_a_hit_makes_blocks_most_recently_used():
    a = PagedAllocator(6, BS)
    start(a, "a", A)
    start(a, "b", B)
    a.free("a")
    a.free("b")
    assert free_queue(a) == [5, 2, 1, 0, 4, 3]
    assert start(a, "a2", A) == 8  # hits 0 and 1; its 9th token takes block 5 (the head)
    a.free("a2")
    assert free_queue(a) == [5, 2, 4, 3, 1, 0]  # a's blocks are now the newest
    start(a, "x", [7] * 16)  # 4 blocks: 5, 2 and all of b's
    assert a.block_table("x") == [5, 2, 4, 3]
    assert a.add_sequence("again", A, max_len=12) == 8


def test_salts_isolate():
    a = PagedAllocator(12, BS)
    start(a, "t1", A, salt="tenant-1")
    assert a.add_sequence("none", A, max_len=12) == 0
    assert a.add_sequence("t2", A, max_len=12, salt="tenant-2") == 0
    assert a.add_sequence("t1b", A, max_len=12, salt="tenant-1") == 8
    start(a, "plain", B)
    assert a.add_sequence("plain-salted", B, max_len=12, salt="x") == 0
    assert a.add_sequence("plain2", B, max_len=12) == 8


def test_generated_tokens_are_cached_too():
    a = PagedAllocator(8, BS)
    start(a, "a", [1, 2, 3])
    a.append("a", [4])  # a decode token completes block 0
    a.append("a", [5, 6, 7, 8, 9])
    ran(a)
    a.free("a")
    assert a.add_sequence("b", list(range(1, 11)), max_len=12) == 8


def test_a_block_is_a_hit_only_once_its_step_ran():
    a = PagedAllocator(8, BS)
    a.add_sequence("a", A, max_len=12)
    a.append("a", A)  # keys blocks 0 and 1: not written yet
    assert a.add_sequence("early", A, max_len=12) == 0
    a.drop_unwritten([0])  # that step failed: its keys are gone for good
    ran(a)
    assert a.add_sequence("after-failure", A, max_len=12) == 0
    a.append("a", [1, 2, 3])  # completes block 2 in another step, which runs
    ran(a)
    assert a.add_sequence("late", A + [1, 2, 3, 4], max_len=16) == 0  # the chain starts unwritten
    a.check_integrity()


def test_a_freed_blocks_key_is_published_while_no_one_took_it_and_dropped_once_one_did():
    a = PagedAllocator(4, BS)
    a.add_sequence("a", A, max_len=12)
    a.append("a", A)
    a.free("a")  # its blocks are free, unkeyed, at the head of the queue
    ran(a)  # the step ran: they are keyed and move to the tail, the last block first
    assert [b.block_id for b in a.pool.free_queue] == [2, 3, 1, 0]
    assert a.add_sequence("b", A, max_len=12) == 8
    a.check_integrity()
    a = PagedAllocator(3, BS)
    a.add_sequence("c", B, max_len=12)
    a.append("c", B)  # keys blocks 0 and 1, not written yet; c ends, and d takes them
    a.free("c")
    a.add_sequence("d", [9] * 8, max_len=12)
    a.append("d", [9] * 8)
    assert a.block_table("d") == [0, 1]
    ran(a)  # c's step "ran", but its blocks hold d's tokens now: only d's keys count
    assert a.add_sequence("e", B, max_len=12) == 0
    assert a.add_sequence("f", [9] * 9, max_len=12) == 8
    a.check_integrity()


def test_hit_and_query_counters():
    a = PagedAllocator(12, BS)
    start(a, "a", A)  # 9 queried, 0 hit
    start(a, "b", A)  # 9 queried, 8 hit
    start(a, "c", A[:5])  # 5 queried, 4 hit
    start(a, "d", [1, 2])  # 2 queried, 0 hit
    assert (a.prefix_cache_queries, a.prefix_cache_hits) == (25, 12)
    assert a.prefix_stats.hit_rate == 12 / 25
    a.admit(A, 12)  # admission looks, but does not count
    assert a.prefix_cache_queries == 25


def test_prefix_caching_off_never_hits_or_counts():
    a = PagedAllocator(8, BS, enable_prefix_caching=False)
    start(a, "a", A)
    a.free("a")
    assert a.add_sequence("b", A, max_len=12) == 0
    assert (a.prefix_cache_queries, a.prefix_cache_hits) == (0, 0)
    assert a.pool.cached == {}


def test_cached_blocks_count_as_free_slots():
    a = PagedAllocator(4, BS)
    start(a, "a", A)
    a.free("a")
    snap = a.snapshot()
    assert (snap.blocks_free, snap.blocks_cached, snap.blocks_referenced) == (2, 2, 0)
    assert snap.free == 16 and snap.token_state == 0


def test_use_cache_false_attaches_nothing_and_its_blocks_are_cached_for_others():
    a = PagedAllocator(8, BS)
    start(a, "a", A)
    queries = a.prefix_cache_queries
    assert a.admit(A, 20, use_cache=False).kind == "yes"
    assert start(a, "b", A, use_cache=False) == 0  # prompt logprobs: every position computed
    assert a.block_table("b")[:2] != a.block_table("a")[:2]
    assert a.prefix_cache_queries == queries  # not a query
    a.free("a")
    a.free("b")
    assert start(a, "c", A) == 8
    a.check_integrity()


def test_a_plan_entry_that_skips_the_prefix_cache():
    from pagedserve.memsvc.step_planner import StepPlanner
    from pagedserve.wire.reserve_messages import Plan, PlanEntry

    a = PagedAllocator(16, BS)
    planner = StepPlanner(a)
    planner.reserve(Plan([PlanEntry("a", A, True, 20)]))
    ran(a)
    r = planner.reserve(Plan([PlanEntry("b", A, True, 20, skip_prefix_cache=True),
                              PlanEntry("c", A, True, 20)])).result
    assert [(g.seq_id, g.start_pos, g.num_cached_tokens) for g in r.grants] == [("b", 0, 0), ("c", 8, 8)]
    a.check_integrity()
