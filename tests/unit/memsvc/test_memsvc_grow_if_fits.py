"""PagedAllocator.grow_if_fits (one lookup) does exactly what the KVAllocator reference
(is_swapped, can_append, num_tokens, grow, table_changes) does, in every state a planner
meets: forks and copy-on-write, pending tokens and fills, a sliding window, swapping, and
a pool too small for everyone."""
import random

import pytest

from pagedserve.memsvc.allocator import KVAllocator
from pagedserve.memsvc.paged_allocator import PagedAllocator
from pagedserve.wire.pending_token import PENDING


def state(alloc: PagedAllocator):
    return (
        alloc.num_free_blocks(), alloc.blocks_released,
        {s: (t.num_tokens, t.block_ids, t.block_keys, t.tail_tokens, t.synced, t.released, t.swapped,
             t.host_blocks) for s, t in alloc._seqs.items()},
    )


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_grow_if_fits_matches_the_reference(seed, caching, window):
    rng = random.Random(seed)
    fast, ref = (PagedAllocator(24, 4, enable_prefix_caching=caching, num_host_blocks=12, window=window)
                 for _ in range(2))
    pending: dict[str, int] = {}  # seq_id -> position of its pending token
    next_id = 0
    for _ in range(600):
        seqs = fast.sequence_ids()
        op = rng.random()
        if not seqs or op < 0.1:
            prompt = [rng.randrange(3) for _ in range(rng.randrange(1, 10))]
            seq_id, next_id = f"s{next_id}", next_id + 1
            try:
                cached = [a.add_sequence(seq_id, prompt, max_len=400) for a in (fast, ref)]
            except Exception as e:  # both raise alike or neither does
                with pytest.raises(type(e)):
                    ref.add_sequence(seq_id, prompt, max_len=400)
                continue
            assert cached[0] == cached[1]
            rest = prompt[cached[0]:]
            assert fast.grow_if_fits(seq_id, rest) == KVAllocator.grow_if_fits(ref, seq_id, rest)
        elif op < 0.2:
            parent = rng.choice(seqs)
            if fast.is_swapped(parent) or parent in pending:
                continue
            seq_id, next_id = f"s{next_id}", next_id + 1
            for a in (fast, ref):
                a.fork(parent, seq_id)
        elif op < 0.27:
            seq_id = rng.choice(seqs)
            pending.pop(seq_id, None)
            for a in (fast, ref):
                a.free(seq_id)
        elif op < 0.34:
            seq_id = rng.choice(seqs)
            for a in (fast, ref):
                if a.is_swapped(seq_id) and a.can_swap_in(seq_id):
                    assert a.swap_in(seq_id) is not None
                elif not a.is_swapped(seq_id) and a.can_swap_out(seq_id):
                    a.swap_out(seq_id)
        else:
            seq_id = rng.choice(seqs)
            if seq_id in pending and not fast.is_swapped(seq_id):  # as a planner: fill, then grow
                token = rng.randrange(3)
                for a in (fast, ref):
                    a.fill(seq_id, pending[seq_id], token)
                del pending[seq_id]
            tokens = [rng.randrange(3) for _ in range(rng.choice([0, 1, 1, 1, 2, 5]))]
            if seq_id not in pending and rng.random() < 0.3:
                tokens.append(PENDING)
            start = fast.num_tokens(seq_id)
            got = fast.grow_if_fits(seq_id, tokens)
            assert got == KVAllocator.grow_if_fits(ref, seq_id, tokens)
            if got is not None and tokens and tokens[-1] == PENDING:
                pending[seq_id] = start + len(tokens) - 1
        assert state(fast) == state(ref)
        fast.check_integrity()


def test_unknown_sequence_is_a_key_error_in_both():
    alloc = PagedAllocator(4, 4)
    with pytest.raises(KeyError, match="unknown sequence"):
        alloc.grow_if_fits("x", [1])
    with pytest.raises(KeyError, match="unknown sequence"):
        KVAllocator.grow_if_fits(alloc, "x", [1])
