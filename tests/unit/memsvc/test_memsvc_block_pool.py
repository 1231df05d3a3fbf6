"""BlockPool, FreeBlockQueue, SwapSpace and RunAllocator as mechanisms, without a policy."""
from __future__ import annotations

import pytest

from pagedserve.memsvc.block_pool import BlockPool, DoubleFree, FreeBlockQueue, IntegrityError, NoFreeBlocks
from pagedserve.memsvc.prefix_cache import block_key, cacheable_blocks, prompt_block_keys
from pagedserve.memsvc.run_allocator import Run, RunAllocator
from pagedserve.memsvc.swap_space import SwapSpace


def ids(blocks):
    return [b.block_id for b in blocks]


def test_free_queue_pops_head_removes_middle_appends_tail():
    pool = BlockPool(5)
    q = pool.free_queue
    assert ids(q) == [0, 1, 2, 3, 4] and len(q) == 5
    q.remove(pool.blocks[2])
    assert ids(q) == [0, 1, 3, 4] and q.num_free == 4
    assert q.popleft() is pool.blocks[0]
    q.append(pool.blocks[2])
    q.appendleft(pool.blocks[0])
    assert ids(q) == [0, 1, 3, 4, 2]
    with pytest.raises(ValueError, match="already in the free queue"):
        q.append(pool.blocks[1])
    empty = FreeBlockQueue()
    with pytest.raises(NoFreeBlocks):
        empty.popleft()


def test_allocate_and_free_restore_counts():
    pool = BlockPool(4)
    got = pool.allocate(3)
    assert ids(got) == [0, 1, 2] and all(b.ref_cnt == 1 for b in got)
    assert pool.num_free == 1 and pool.counts() == (1, 0, 3)
    with pytest.raises(NoFreeBlocks, match="needs 2 free blocks, 1 free"):
        pool.allocate(2)
    assert pool.num_free == 1  # unchanged by the failed call
    pool.free(reversed(got))
    assert pool.num_free == 4 and pool.counts() == (4, 0, 0)
    pool.check()


def test_double_free_raises_and_changes_nothing():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.free([a])
    with pytest.raises(DoubleFree, match="block 0 freed twice"):
        pool.free([b, a])
    assert b.ref_cnt == 1  # the valid block in the failed call was not freed either
    with pytest.raises(DoubleFree):
        pool.free([b, b])
    pool.check()


def test_incref_of_a_free_cached_block_takes_it_out_of_the_queue():
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    assert pool.cache(b, b"k")
    pool.free([b])
    assert pool.counts() == (2, 1, 0) and pool.lookup(b"k") is b
    pool.incref([b])
    assert b.ref_cnt == 1 and pool.num_free == 2 and b.key == b"k"
    pool.check()


def test_keyed_blocks_go_to_the_tail_keyless_to_the_head_and_allocation_evicts():
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    pool.cache(blocks[0], b"a")
    pool.cache(blocks[1], b"b")
    pool.free(reversed(blocks))  # 3 and 2 (keyless) to the head; 1 then 0 to the tail
    assert ids(pool.free_queue) == [2, 3, 1, 0]
    got = pool.allocate(3)
    assert ids(got) == [2, 3, 1]
    assert pool.lookup(b"b") is None and got[2].key is None  # evicted on allocation
    assert pool.lookup(b"a") is blocks[0]
    pool.check()


def test_a_key_names_one_block():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    assert pool.cache(a, b"k") and not pool.cache(b, b"k")
    assert b.key is None and pool.lookup(b"k") is a


def test_integrity_check_names_the_broken_block():
    pool = BlockPool(3)
    pool.allocate(1)
    pool.blocks[1].ref_cnt = 1  # corrupt: referenced yet still in the free queue
    with pytest.raises(IntegrityError, match="free queue: block 1 has ref count 1"):
        pool.check()


def test_block_keys_are_chained_salted_and_stable():
    k1 = block_key(None, [1, 2, 3, 4])
    assert k1 == block_key(None, [1, 2, 3, 4])  # deterministic
    assert k1.hex() == block_key(None, (1, 2, 3, 4)).hex()  # any sequence type
    assert block_key(k1, [5, 6]) != block_key(None, [5, 6])  # chained through the parent
    assert block_key(None, [1], "tenant-a") != block_key(None, [1], "tenant-b")
    assert block_key(None, [1], "") != block_key(None, [1], None)
    assert block_key(None, [1, 2]) != block_key(None, [12])
    keys = prompt_block_keys(list(range(10)), 4)
    assert len(keys) == 2 and keys[1] == block_key(keys[0], [4, 5, 6, 7])
    assert [cacheable_blocks(n, 4) for n in (1, 4, 5, 8, 9)] == [0, 0, 1, 1, 2]


def test_swap_space_free_list():
    host = SwapSpace(3)
    assert host.allocate(2) == [0, 1] and host.num_free == 1
    with pytest.raises(NoFreeBlocks, match="needs 2 host blocks, 1 of 3 free"):
        host.allocate(2)
    host.free([0])
    with pytest.raises(DoubleFree, match="host block 0 freed twice"):
        host.free([0])
    host.check([1])
    with pytest.raises(IntegrityError):
        host.check([0, 1])
    assert SwapSpace(0).num_free == 0


def test_first_fit_makes_real_holes_and_merges_on_free():
    runs = RunAllocator(10)
    a, b, c = runs.allocate(3), runs.allocate(2), runs.allocate(4)
    assert (a, b, c) == (Run(0, 3), Run(3, 2), Run(5, 4))
    runs.free(b)  # a hole of 2 between a and c
    assert runs.free_runs() == [Run(3, 2), Run(9, 1)]
    assert runs.num_free == 3 and runs.largest_free_run() == 2
    with pytest.raises(NoFreeBlocks, match="no run of 3 consecutive free blocks"):
        runs.allocate(3)  # 3 blocks are free, but not consecutively
    assert runs.allocate(1) == Run(3, 1)  # first fit: the lowest hole that fits
    runs.check([a, Run(3, 1), c])
    runs.free(Run(3, 1))
    runs.free(c)  # merges [3,5) + [5,9) + [9,10)
    assert runs.free_runs() == [Run(3, 7)]
    with pytest.raises(DoubleFree):
        runs.free(Run(4, 2))
    runs.free(a)
    assert runs.free_runs() == [Run(0, 10)]
    runs.check([])


def test_run_integrity_check_finds_overlaps_and_gaps():
    runs = RunAllocator(6)
    a = runs.allocate(3)
    with pytest.raises(IntegrityError, match="leaves a gap"):
        runs.check([])
    with pytest.raises(IntegrityError, match="overlaps"):
        runs.check([a, Run(2, 1)])
