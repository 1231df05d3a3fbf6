"""PagedAllocator: block counts, slots, admission, fork and copy-on-write, swap, integrity."""
from __future__ import annotations

import pytest

from pagedserve.memsvc import (
    POLICIES,
    ContiguousAllocator,
    IntegrityError,
    NoFreeBlocks,
    PagedAllocator,
    make_allocator,
)
from tests.support.written import ran

BS = 4


def paged(num_blocks=10, **kw) -> PagedAllocator:
    return PagedAllocator(num_blocks, BS, **kw)


def start(alloc, seq_id, prompt, max_len=None, **kw):
    """Register and give slots to the whole prompt; returns (cached, AppendResult)."""
    cached = alloc.add_sequence(seq_id, prompt, max_len=max_len or len(prompt) + 8, **kw)
    appended = alloc.append(seq_id, prompt[cached:])
    ran(alloc)  # the step ran: the blocks it keyed are prefix-cache hits from now on
    return cached, appended


def test_blocks_follow_ceil_and_grow_only_when_the_last_is_full():
    a = paged(enable_prefix_caching=False)
    assert a.add_sequence("s", list(range(10)), max_len=20) == 0
    assert a.block_table("s") == [] and a.num_tokens("s") == 0
    assert a.num_new_blocks("s", 10) == 3  # ceil(10 / 4)
    r = a.append("s", list(range(10)))
    assert r.slot_mapping == list(range(10)) and r.copies == []
    assert a.block_table("s") == [0, 1, 2] and a.num_free_blocks() == 7
    assert a.num_new_blocks("s", 2) == 0 and a.num_new_blocks("s", 3) == 1
    assert a.append("s", [10, 11]).slot_mapping == [10, 11]  # fills block 2, no new block
    assert a.num_free_blocks() == 7
    assert a.append("s", [12]).slot_mapping == [12]  # block 3, offset 0
    assert a.block_table("s") == [0, 1, 2, 3] and a.num_tokens("s") == 13
    a.check_integrity()


def test_slot_mapping_follows_the_block_table():
    a = paged(6, enable_prefix_caching=False)
    start(a, "x", [1] * 5)  # blocks 0, 1
    start(a, "y", [2] * 3)  # block 2
    r = a.append("x", [3, 4, 5, 6])  # positions 5..8: block 1 offsets 1..3, then block 3
    assert a.block_table("x") == [0, 1, 3]
    assert r.slot_mapping == [1 * BS + 1, 1 * BS + 2, 1 * BS + 3, 3 * BS + 0]


def test_free_restores_everything():
    a = paged(8, num_host_blocks=4)
    start(a, "a", list(range(9)))
    a.fork("a", "b")
    a.append("b", [100, 101])
    start(a, "c", list(range(9)))  # a prefix hit on a's blocks
    a.swap_out("c")
    for seq_id in ("a", "b", "c"):
        a.free(seq_id)
    assert a.num_free_blocks() == 8 and a.swap_space.num_free == 4
    snap = a.snapshot()
    assert snap.free == snap.total_slots == 32 and snap.blocks_referenced == 0
    assert snap.token_state == snap.reserved == snap.internal_fragmentation == 0
    a.check_integrity()


def test_failed_append_changes_nothing():
    a = paged(3, enable_prefix_caching=False)
    start(a, "a", [1] * 9)  # all 3 blocks, last one partial
    before = (a.block_table("a"), a.num_tokens("a"), a.num_free_blocks())
    assert not a.can_append("a", 4)
    with pytest.raises(NoFreeBlocks, match="needs 1 blocks for 4 more tokens, 0 free"):
        a.append("a", [1, 2, 3, 4])
    assert (a.block_table("a"), a.num_tokens("a"), a.num_free_blocks()) == before
    a.check_integrity()


def test_admission_never_names_the_limit():
    a = PagedAllocator(256, 16)
    adm = a.admit([7] * 800, 4800)
    assert adm.kind == "never"
    assert adm.reason == (
        "needs 300 blocks of 16 tokens for 4800 tokens (prompt 800 + max_tokens 4000)"
        " but the pool has 256 blocks"
    )
    assert a.admit([7] * 800, 4096).kind == "yes"  # exactly 256 blocks


def test_admission_waits_while_the_prompt_blocks_are_taken():
    a = paged(4, enable_prefix_caching=False)
    start(a, "big", [1] * 12)  # 3 of 4 blocks
    adm = a.admit([2] * 5, 10)  # needs 2 blocks for its prompt, 1 free
    assert adm.kind == "wait" and "needs 2 free blocks" in adm.reason and "1 are free" in adm.reason
    assert a.admit([2] * 4, 16).kind == "yes"  # the prompt fits now; growth is later's problem
    a.free("big")
    assert a.admit([2] * 5, 10).kind == "yes"
    with pytest.raises(ValueError, match="at least one token"):
        a.admit([], 4)


def test_admission_counts_cached_prompt_blocks_and_those_they_revive():
    a = paged(4)
    start(a, "a", list(range(9)))  # blocks 0, 1 keyed, 2 partial
    a.free("a")  # all free; 0 and 1 still cached
    start(a, "filler", [50, 51])  # takes block 2 (keyless, at the head)
    start(a, "filler2", [60])  # takes block 3
    assert a.num_free_blocks() == 2  # the two cached blocks
    # same prefix: 2 blocks cached, 1 to allocate, but the free ones are the cached ones
    adm = a.admit(list(range(9)), 12)
    assert adm.kind == "wait" and "needs 1 free blocks (2 more cached)" in adm.reason
    assert "0 are free" in adm.reason
    a.free("filler2")
    assert a.admit(list(range(9)), 12).kind == "yes"
    assert a.prefix_cache_queries == 9 + 2 + 1  # admit counts nothing


def test_fork_shares_every_block_and_allocates_nothing():
    a = paged(8)
    start(a, "p", [1, 2, 3, 4, 5, 6])  # blocks 0 (full), 1 (2 of 4)
    free = a.num_free_blocks()
    a.fork("p", "c")
    assert a.block_table("c") == a.block_table("p") == [0, 1]
    assert a.num_tokens("c") == 6 and a.num_free_blocks() == free
    assert [a.pool.blocks[i].ref_cnt for i in (0, 1)] == [2, 2]
    a.check_integrity()


def test_copy_on_write_of_a_shared_partial_last_block():
    a = paged(8)
    start(a, "p", [1, 2, 3, 4, 5, 6])  # blocks 0, 1; free queue head is now block 2
    a.fork("p", "c")
    assert a.num_new_blocks("c", 1) == 1  # the copy
    r = a.append("c", [70])
    assert r.copies == [(1, 2)]  # copy block 1 into block 2 before writing
    assert r.slot_mapping == [2 * BS + 2]
    assert a.block_table("c") == [0, 2] and a.block_table("p") == [0, 1]
    assert a.pool.blocks[1].ref_cnt == 1 and a.pool.blocks[0].ref_cnt == 2
    r = a.append("p", [80])  # block 1 is p's alone now: written in place
    assert r.copies == [] and r.slot_mapping == [1 * BS + 2]
    a.check_integrity()


def test_copy_on_write_then_growth_in_one_append():
    a = paged(8)
    start(a, "p", [1, 2, 3, 4, 5, 6])
    a.fork("p", "c")
    assert a.num_new_blocks("c", 3) == 2  # copy of block 1, plus one block for position 8
    r = a.append("c", [7, 8, 9])
    assert r.copies == [(1, 2)] and r.slot_mapping == [2 * BS + 2, 2 * BS + 3, 3 * BS + 0]


def test_a_shared_full_last_block_is_never_written_or_copied():
    a = paged(8)
    start(a, "p", list(range(8)))  # blocks 0, 1, both full
    a.fork("p", "c")
    assert a.num_new_blocks("c", 1) == 1
    r = a.append("c", [99])
    assert r.copies == [] and r.slot_mapping == [2 * BS]  # a new block 2
    assert a.block_table("c") == [0, 1, 2] and a.pool.blocks[1].ref_cnt == 2
    assert a.append("p", [98]).copies == []
    a.check_integrity()


def test_fork_and_cow_without_prefix_caching():
    a = paged(8, enable_prefix_caching=False)
    start(a, "p", [1, 2, 3, 4, 5])
    a.fork("p", "c")
    assert a.append("c", [6]).copies == [(1, 2)]
    a.free("p")
    a.free("c")
    assert a.num_free_blocks() == 8 and a.pool.counts() == (8, 0, 0)


def test_unknown_and_duplicate_ids():
    a = paged()
    start(a, "a", [1, 2])
    with pytest.raises(ValueError, match="already registered"):
        a.add_sequence("a", [1], max_len=4)
    with pytest.raises(ValueError, match="already registered"):
        a.fork("a", "a")
    a.free("a")
    with pytest.raises(KeyError, match="unknown sequence 'a'"):
        a.free("a")  # a second free of the same sequence
    for call in (lambda: a.append("zz", [1]), lambda: a.block_table("zz"), lambda: a.fork("zz", "y")):
        with pytest.raises(KeyError):
            call()
    assert not a.has_sequence("a")
    with pytest.raises(ValueError, match="shorter than the prompt"):
        a.add_sequence("b", [1, 2, 3], max_len=2)


def test_integrity_check_reports_a_ref_count_mismatch():
    a = paged()
    start(a, "a", list(range(6)))
    a.pool.blocks[1].ref_cnt += 1
    with pytest.raises(IntegrityError, match=r"block 1 has ref count 2 but 1 block tables hold it \['a'\]"):
        a.check_integrity()
    a.pool.blocks[1].ref_cnt -= 1
    a.check_integrity()
    a._seqs["a"].num_tokens = 9  # claims a third block it does not hold
    with pytest.raises(IntegrityError, match="'a': 9 tokens need 3 blocks but it holds 2 device"):
        a.check_integrity()


def test_swap_out_and_in_round_trip():
    a = paged(6, num_host_blocks=4)
    start(a, "s", list(range(6)))  # blocks 0, 1
    assert a.can_swap_out("s")
    out = a.swap_out("s")
    assert out == [(0, 0), (1, 1)]  # (device, host)
    assert a.is_swapped("s") and a.num_tokens("s") == 6
    assert a.num_free_blocks() == 6 and a.swap_space.num_free == 2
    a.check_integrity()
    with pytest.raises(ValueError, match="swapped out"):
        a.append("s", [1])
    with pytest.raises(ValueError, match="swapped out"):
        a.block_table("s")
    start(a, "other", [9] * 5)  # takes blocks 2, 3 (keyless blocks before cached ones)
    assert a.can_swap_in("s")
    back = a.swap_in("s")
    assert [h for h, _ in back] == [0, 1]
    assert [d for _, d in back] == a.block_table("s")  # (host, device) into fresh blocks
    assert a.swap_space.num_free == 4 and not a.is_swapped("s")
    r = a.append("s", [6])
    assert r.slot_mapping == [a.block_table("s")[1] * BS + 2]
    a.check_integrity()


def test_swap_needs_space_on_both_sides():
    a = paged(4, num_host_blocks=1)
    start(a, "s", list(range(6)))
    assert not a.can_swap_out("s")
    with pytest.raises(NoFreeBlocks):
        a.swap_out("s")
    assert not a.is_swapped("s") and a.block_table("s") == [0, 1]
    b = paged(4, num_host_blocks=4, enable_prefix_caching=False)
    start(b, "s", list(range(6)))
    b.swap_out("s")
    start(b, "t", [1] * 12)  # 3 of 4 blocks
    assert not b.can_swap_in("s")
    with pytest.raises(NoFreeBlocks):
        b.swap_in("s")
    assert b.is_swapped("s")
    with pytest.raises(ValueError, match="not swapped out"):
        b.swap_in("t")
    b.free("s")  # a swapped sequence frees its host blocks
    assert b.swap_space.num_free == 4
    b.check_integrity()


def test_swapping_out_a_forked_sequence_copies_shared_blocks():
    a = paged(8, num_host_blocks=4)
    start(a, "p", list(range(6)))
    a.fork("p", "c")
    assert a.swap_out("c") == [(0, 0), (1, 1)]
    assert [a.pool.blocks[i].ref_cnt for i in (0, 1)] == [1, 1]  # still p's
    a.check_integrity()
    back = a.swap_in("c")
    assert all(d not in (0, 1) for _, d in back)  # fresh blocks, no longer shared
    assert a.append("c", [9]).copies == []
    a.check_integrity()


def test_make_allocator():
    assert POLICIES == ("paged", "contiguous-max", "contiguous-pow2", "contiguous-oracle")
    p = make_allocator("paged", 8, 4, max_model_len=64, enable_prefix_caching=False, num_host_blocks=2)
    assert isinstance(p, PagedAllocator) and not p.enable_prefix_caching and p.swap_space.num_blocks == 2
    for policy in POLICIES[1:]:
        c = make_allocator(policy, 8, 4, max_model_len=64)
        assert isinstance(c, ContiguousAllocator) and c.policy == policy
    with pytest.raises(ValueError, match="choose one of paged, contiguous-max, contiguous-pow2"):
        make_allocator("buddy", 8, 4, max_model_len=64)
