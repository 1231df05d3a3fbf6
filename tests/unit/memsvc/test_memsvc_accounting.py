"""Where the slots go, computed by hand, for every policy on the same two requests.

Pool: 32 blocks of 4 tokens = 128 slots; max_model_len 32 tokens (8 blocks).
r1: prompt 5, max_len 12, final_len 9, holds 7 tokens now (prompt + 2 decoded).
r2: prompt 3, max_len 20, final_len 6, holds 3 tokens now (just prefilled).
"""
from __future__ import annotations

import pytest

from pagedserve.memsvc import PoolSnapshot, make_allocator
from tests.support.written import ran

BS, NUM_BLOCKS, MAX_MODEL_LEN = 4, 32, 32


def run_workload(policy):
    a = make_allocator(policy, NUM_BLOCKS, BS, max_model_len=MAX_MODEL_LEN)
    a.add_sequence("r1", [1] * 5, max_len=12, final_len=9)
    a.append("r1", [1] * 5)
    a.append("r1", [2])
    a.append("r1", [3])
    a.add_sequence("r2", [4] * 3, max_len=20, final_len=6)
    a.append("r2", [4] * 3)
    a.check_integrity()
    return a


def slots(s: PoolSnapshot):
    return (s.token_state, s.reserved, s.internal_fragmentation, s.external_fragmentation, s.free)


def test_contiguous_max():
    # each reserves 32 tokens = 8 blocks: r1 [0, 8), r2 [8, 16); free run [16, 32)
    # r1: 7 held, 9 - 7 = 2 reserved, 32 - 9 = 23 internal
    # r2: 3 held, 6 - 3 = 3 reserved, 32 - 6 = 26 internal
    a = run_workload("contiguous-max")
    assert a.block_table("r1") == [0, 1] and a.block_table("r2") == [8]
    s = a.snapshot()
    assert slots(s) == (10, 5, 49, 0, 64)
    assert (s.blocks_free, s.blocks_cached, s.blocks_referenced) == (16, 0, 16)
    assert s.token_state_fraction == pytest.approx(10 / 128)


def test_contiguous_pow2():
    # r1: next_pow2(12) = 16 tokens = 4 blocks [0, 4); r2: next_pow2(20) = 32 = 8 blocks [4, 12)
    # r1: 7 held, 2 reserved, 16 - 9 = 7 internal; r2: 3 held, 3 reserved, 32 - 6 = 26 internal
    a = run_workload("contiguous-pow2")
    assert a.block_table("r2") == [4]
    assert slots(a.snapshot()) == (10, 5, 33, 0, 80)


def test_contiguous_oracle():
    # r1: 9 tokens = 3 blocks [0, 3); r2: 6 tokens = 2 blocks [3, 5)
    # r1: 7 held, 2 reserved, 12 - 9 = 3 internal; r2: 3 held, 3 reserved, 8 - 6 = 2 internal
    a = run_workload("contiguous-oracle")
    assert a.block_table("r2") == [3]
    assert slots(a.snapshot()) == (10, 5, 5, 0, 108)


def test_paged():
    # r1: 7 tokens in 2 blocks (8 slots): 7 held, 1 reserved (9 > 8: the rest is not yet
    # allocated), 0 internal; r2: 3 tokens in 1 block: 3 held, 1 reserved (to 4), 0 internal
    a = run_workload("paged")
    s = a.snapshot()
    assert slots(s) == (10, 2, 0, 0, 116)
    assert (s.blocks_free, s.blocks_cached, s.blocks_referenced) == (29, 0, 3)
    # without known final lengths every unfilled allocated slot counts as reserved
    b = make_allocator("paged", NUM_BLOCKS, BS, max_model_len=MAX_MODEL_LEN)
    b.add_sequence("r", [1] * 5, max_len=12)
    b.append("r", [1] * 5)
    assert slots(b.snapshot()) == (5, 3, 0, 0, 120)


def test_paged_internal_fragmentation_and_shared_blocks_count_once():
    a = make_allocator("paged", 8, 4, max_model_len=64)
    a.add_sequence("a", [1] * 6, max_len=8, final_len=7)
    a.append("a", [1] * 6)  # blocks 0, 1: 6 held, 1 reserved (pos 6), 1 internal (pos 7)
    a.add_sequence("b", [2] * 5, max_len=12)
    a.append("b", [2] * 5)  # blocks 2, 3: 5 held, 3 reserved (final length unknown)
    a.add_sequence("d", [3] * 4, max_len=8)
    a.append("d", [3] * 4)
    ran(a)
    a.free("d")  # block 4 stays cached: free slots
    a.fork("a", "c")  # shares blocks 0 and 1: nothing changes
    s = a.snapshot()
    assert slots(s) == (11, 4, 1, 0, 16)
    assert (s.blocks_free, s.blocks_cached, s.blocks_referenced) == (3, 1, 4)
    assert s.token_state_fraction == 11 / 32
    # c writes position 6: copy-on-write of block 1 into block 5 (the free queue's head)
    assert a.append("c", [9]).copies == [(1, 5)]
    # block 0: 4 held; block 1 (a): 2 held, 1 reserved, 1 internal; block 5 (c): 3 held,
    # 1 internal; blocks 2, 3 (b): 5 held, 3 reserved; free: blocks 6, 7 and cached 4
    assert slots(a.snapshot()) == (14, 4, 2, 0, 12)


def test_contiguous_external_fragmentation_from_holes():
    # oracle, 12 blocks: A [0, 2), B [2, 5), C [5, 7), D [7, 11); free B and D:
    # free runs [2, 5) (3 blocks) and [7, 12) (5 blocks, merged with the never-used 11)
    a = make_allocator("contiguous-oracle", 12, 4, max_model_len=32)
    for seq_id, final in (("A", 8), ("B", 12), ("C", 8), ("D", 16)):
        a.add_sequence(seq_id, [1] * 5, max_len=final, final_len=final)
    a.append("A", [1] * 5)  # 5 held, 3 reserved
    a.append("C", [1] * 8)  # 8 held
    a.free("B")
    a.free("D")
    assert [(r.start, r.length) for r in a.runs.free_runs()] == [(2, 3), (7, 5)]
    # a 4-block request cannot use the 3-block hole: 12 slots external, 20 free
    assert slots(a.snapshot(next_request_blocks=4)) == (13, 3, 0, 12, 20)
    # None: the reservation for a max_model_len request, 8 blocks: both runs are too short
    assert slots(a.snapshot()) == (13, 3, 0, 32, 0)
    assert slots(a.snapshot(next_request_blocks=1)) == (13, 3, 0, 0, 32)
    # admission sees the holes: 8 blocks are free, but no run of 6
    assert a.admit([1] * 5, 16, final_len=16).kind == "yes"
    adm = a.admit([1] * 5, 24, final_len=24)
    assert adm.kind == "wait" and "run of 6 consecutive free blocks" in adm.reason
    assert "longest free run is 5 blocks" in adm.reason and a.num_free_blocks() == 8
    a.add_sequence("E", [1] * 5, max_len=12, final_len=12)  # first fit: into the hole at 2
    assert a.reserved_run("E").start == 2
    a.check_integrity()


def test_snapshot_validates_and_exports():
    s = PoolSnapshot(3, 1, 0, 0, 4, 8, 2, 1, 0, 1)
    d = s.as_dict()
    assert d["token_state"] == 3 and d["token_state_fraction"] == 3 / 8
    with pytest.raises(ValueError, match="slot categories sum to 9"):
        PoolSnapshot(3, 1, 0, 0, 5, 8, 2, 1, 0, 1)
    with pytest.raises(ValueError, match="block counts sum to 3"):
        PoolSnapshot(3, 1, 0, 0, 4, 8, 2, 1, 1, 1)
