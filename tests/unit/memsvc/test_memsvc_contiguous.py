"""ContiguousAllocator: reservations per policy, consecutive block tables, admission."""
from __future__ import annotations

import pytest

from pagedserve.memsvc import ContiguousAllocator, NoFreeBlocks
from pagedserve.memsvc.contiguous_allocator import next_pow2


def test_reservation_sizes_per_policy():
    def blocks(policy, max_len, final_len=None, max_model_len=64):
        return ContiguousAllocator(100, 4, policy, max_model_len).reservation_blocks(max_len, final_len)

    assert blocks("contiguous-max", 10) == 16  # 64 tokens, whatever the request
    assert blocks("contiguous-pow2", 10) == 4  # 16 tokens
    assert blocks("contiguous-pow2", 17) == 8  # 32 tokens
    assert blocks("contiguous-pow2", 40, max_model_len=48) == 12  # 64 capped at 48
    assert blocks("contiguous-oracle", 40, final_len=13) == 4
    assert blocks("contiguous-oracle", 40) == 10  # final length unknown: max_len
    assert [next_pow2(n) for n in (1, 2, 3, 16, 17)] == [1, 2, 4, 16, 32]


def test_the_whole_run_is_reserved_up_front_and_the_block_table_is_consecutive():
    a = ContiguousAllocator(20, 4, "contiguous-pow2", 64)
    a.add_sequence("x", [1] * 3, max_len=3)
    assert a.add_sequence("s", [1] * 6, max_len=20) == 0  # no prefix caching: 0 cached
    assert a.reserved_run("s").start == 1 and a.reserved_run("s").length == 8
    assert a.num_free_blocks() == 20 - 1 - 8
    assert a.num_new_blocks("s", 6) == 0 and a.can_append("s", 6)
    r = a.append("s", list(range(6)))
    assert r.slot_mapping == list(range(4, 10)) and r.copies == []
    assert a.block_table("s") == [1, 2]
    a.append("s", list(range(7)))
    assert a.block_table("s") == [1, 2, 3, 4] and a.num_tokens("s") == 13
    a.check_integrity()


def test_appending_past_the_reservation_is_an_error():
    a = ContiguousAllocator(20, 4, "contiguous-oracle", 64)
    a.add_sequence("s", [1] * 3, max_len=10, final_len=5)  # 2 blocks = 8 slots
    a.append("s", [1] * 8)
    with pytest.raises(ValueError, match="would hold 9 tokens but contiguous-oracle reserved 8"):
        a.append("s", [1])
    assert a.num_tokens("s") == 8


def test_admission_never_and_wait():
    a = ContiguousAllocator(4, 4, "contiguous-max", 32)
    adm = a.admit([1] * 5, 10)
    assert adm.kind == "never"
    assert adm.reason == (
        "contiguous-max reserves 8 blocks of 4 tokens for 10 tokens (prompt 5 + max_tokens 5)"
        " but the pool has 4 blocks"
    )
    b = ContiguousAllocator(8, 4, "contiguous-max", 16)
    b.add_sequence("s", [1], max_len=2)
    assert b.admit([1], 2).kind == "yes"
    b.add_sequence("t", [1], max_len=2)
    adm = b.admit([1], 2)
    assert adm.kind == "wait" and "longest free run is 0 blocks" in adm.reason
    with pytest.raises(NoFreeBlocks):
        b.add_sequence("u", [1], max_len=2)
    assert not b.has_sequence("u") and b.num_free_blocks() == 0
    b.check_integrity()


def test_fork_is_not_supported():
    a = ContiguousAllocator(8, 4, "contiguous-oracle", 16)
    a.add_sequence("s", [1], max_len=2)
    with pytest.raises(NotImplementedError, match="needs the 'paged' policy"):
        a.fork("s", "t")


def test_ids_and_validation():
    with pytest.raises(ValueError, match="unknown contiguous policy 'paged'"):
        ContiguousAllocator(8, 4, "paged", 16)
    a = ContiguousAllocator(8, 4, "contiguous-oracle", 16)
    a.add_sequence("s", [1, 2], max_len=4)
    with pytest.raises(ValueError, match="already registered"):
        a.add_sequence("s", [1], max_len=2)
    with pytest.raises(ValueError, match="final_len 1 is shorter than the prompt"):
        a.add_sequence("t", [1, 2], max_len=4, final_len=1)
    with pytest.raises(ValueError, match="final_len must be in"):
        a.add_sequence("t", [1, 2], max_len=4, final_len=5)
    assert a.num_free_blocks() == 7  # the failed adds reserved nothing
    a.free("s")
    with pytest.raises(KeyError):
        a.free("s")
    assert a.num_free_blocks() == 8
    a.check_integrity()


def test_only_the_paged_allocator_swaps():
    from pagedserve.memsvc import make_allocator
    from pagedserve.memsvc.step_planner import StepPlanner

    for policy, swaps in (("paged", True), ("contiguous-max", False), ("contiguous-oracle", False)):
        allocator = make_allocator(policy, 16, 4, max_model_len=64, num_host_blocks=8)
        assert allocator.supports_swap is swaps
        assert StepPlanner(allocator).can_swap is swaps
