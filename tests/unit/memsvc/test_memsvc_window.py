"""Sliding window: blocks that left every layer's window go back to the pool, with the
prefix cache, forks and swapping still correct."""
from pagedserve.memsvc.paged_allocator import PagedAllocator
from tests.support.written import ran


def grow(alloc, seq_id, tokens):
    return alloc.append(seq_id, tokens)


def test_blocks_before_the_window_are_freed():
    alloc = PagedAllocator(32, 4, enable_prefix_caching=False, window=8)
    alloc.add_sequence("a", list(range(12)), max_len=200)
    grow(alloc, "a", list(range(12)))  # positions 0..11 computed: nothing can be freed yet
    assert alloc.num_free_blocks() == 29
    alloc.table_changes("a")
    for t in range(40):
        grow(alloc, "a", [t])
        alloc.check_integrity()
    # the last step computed position 51, which reads 44..51: blocks 11 and 12 are live
    table = alloc._seqs["a"]
    assert table.released == 11 and len(table.blocks) == 13
    assert alloc.num_free_blocks() == 32 - 2
    # released entries travel as block 0 (never read by the windowed kernels)
    assert alloc.block_table("a")[:11] == [0] * 11
    start, new = alloc.table_changes("a")
    assert start >= 3 and all(b == 0 for b in new[: max(0, 11 - start)])
    alloc.free("a")
    assert alloc.num_free_blocks() == 32
    alloc.check_integrity()


def test_window_never_frees_what_a_chunk_reads():
    alloc = PagedAllocator(32, 4, enable_prefix_caching=False, window=6)
    alloc.add_sequence("a", list(range(30)), max_len=64)
    grow(alloc, "a", list(range(10)))
    grow(alloc, "a", list(range(10)))  # queries at 10..19 read from position 5: block 1 on
    assert alloc._seqs["a"].released == 1
    grow(alloc, "a", list(range(10)))  # queries at 20..29 read from 15: block 3 on
    assert alloc._seqs["a"].released == 3
    alloc.check_integrity()


def test_prefix_cache_still_matches_released_blocks():
    alloc = PagedAllocator(64, 4, enable_prefix_caching=True, window=5)
    prompt = list(range(100, 124))  # 6 full blocks
    alloc.add_sequence("a", prompt, max_len=80)
    grow(alloc, "a", prompt)
    ran(alloc)  # each step runs before the next frees blocks that left the window
    for t in range(10):
        grow(alloc, "a", [t])
        ran(alloc)
    assert alloc._seqs["a"].released > 0
    alloc.check_integrity()
    # a second prompt with the same prefix still finds every full block (released blocks
    # stay cached until evicted), and its first step releases them again
    cached = alloc.add_sequence("b", prompt + [7, 8], max_len=80)
    assert cached == 24
    alloc.check_integrity()
    grow(alloc, "b", [7, 8])
    assert alloc._seqs["b"].released == (24 - 5 + 1) // 4
    alloc.check_integrity()


def test_fork_and_swap_keep_the_holes():
    alloc = PagedAllocator(40, 4, enable_prefix_caching=True, num_host_blocks=40, window=6)
    alloc.add_sequence("a", list(range(20)), max_len=80)
    grow(alloc, "a", list(range(20)))
    grow(alloc, "a", [1])
    assert alloc._seqs["a"].released == 3
    alloc.fork("a", "b")
    alloc.check_integrity()
    grow(alloc, "b", [2])
    free_before = alloc.num_free_blocks()
    pairs = alloc.swap_out("a")
    assert len(pairs) == len(alloc._seqs["a"].host_blocks) == 6 - 3
    alloc.check_integrity()
    back = alloc.swap_in("a")
    assert len(back) == 3 and alloc._seqs["a"].released == 3
    assert alloc.block_table("a")[:3] == [0, 0, 0]
    grow(alloc, "a", [3])
    alloc.check_integrity()
    alloc.free("a")
    alloc.free("b")
    alloc.check_integrity()
    assert alloc.num_free_blocks() == 40 and free_before < 40
