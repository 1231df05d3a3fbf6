"""The step of every running sequence of a plan at once: a paged allocator's fast path.

`grow_running` gives exactly what `grow_if_fits` would give each sequence in plan order
(the reference), in the common case where that needs no decision: every sequence is held
on the device, none may copy its last block, and their new blocks all fit among the free
ones (then none is refused or preempted, and allocating in plan order hands out the same
blocks). Otherwise, or with a sliding window (its releases interleave with allocations),
it changes nothing and answers None: the caller goes one sequence at a time.

Check, then act: the check looks at no sequence one by one unless the free blocks are
too few for the most the step could take; the act is one pass over the sequences (their
count and tokens), then one call per sequence that takes a block, fills one, or whose
table the gateway has not been told in full.
"""
from __future__ import annotations

from operator import attrgetter

from pagedserve.memsvc.allocator import RunGrowth

NUM_TOKENS = attrgetter("num_tokens")
SWAPPED = attrgetter("swapped")
SYNCED = attrgetter("synced")
TAIL = attrgetter("tail_tokens")


def grow_running(alloc, seq_ids: list[str], counts: list[int], tokens: list[int]) -> RunGrowth | None:
    """`alloc`: the PagedAllocator (this is its own code, split out). `tokens`: every
    sequence's new tokens, `counts[i]` of them for `seq_ids[i]`, in order."""
    n = len(seq_ids)
    tables = list(map(alloc._seqs.get, seq_ids))
    if alloc.window is not None or not all(tables) or any(map(SWAPPED, tables)):
        return None
    if alloc.shared_tails and alloc._may_copy():
        return None
    bs, pool = alloc.block_size, alloc.pool
    ones = len(tokens) == n and counts.count(1) == n
    most = n if ones else n + -(-len(tokens) // bs)  # blocks_for(nt + c) - blocks_for(nt) <= ceil(c / bs)
    if most > pool.num_free and _need(tables, counts, bs) > pool.num_free:
        return None
    # -- act: nothing has changed so far --
    starts = list(map(NUM_TOKENS, tables))
    synced = list(map(SYNCED, tables))
    caching = alloc.enable_prefix_caching
    if ones:
        for table in tables:
            table.num_tokens += 1
        grow = [(i, 1) for i, nt in enumerate(starts) if not nt % bs]
        stale = [i for i, (s, nt) in enumerate(zip(synced, starts)) if s != nt // bs + 1]
        full = _append(zip(map(TAIL, tables), tokens), tables, bs) if caching else ()
    else:
        for table, c in zip(tables, counts):
            table.num_tokens += c
        grow = [(i, k) for i, (t, c) in enumerate(zip(tables, counts))
                if (k := -(-t.num_tokens // bs) - len(t.blocks))]
        stale = [i for i, (s, t) in enumerate(zip(synced, tables)) if s != -(-t.num_tokens // bs)]
        full = _extend(tables, counts, tokens, bs) if caching else ()
    if grow:
        fresh = pool.allocate(sum(k for _, k in grow))
        at = 0
        for i, k in grow:
            tables[i].blocks += fresh[at:at + k]
            at += k
    for table in full:  # once its blocks are in
        alloc._key_tail(table)
    num_new = [0] * n
    new_blocks: list[int] = []
    for i in stale:
        _, blocks = alloc._table_changes(tables[i])
        num_new[i] = len(blocks)
        new_blocks += blocks
    return starts, synced, num_new, new_blocks


def _append(tails_tokens, tables, bs):
    """Append one token to each tail; the tables whose tail then holds a full block."""
    full = []
    for i, (tail, token) in enumerate(tails_tokens):
        tail.append(token)
        if len(tail) >= bs:
            full.append(tables[i])
    return full


def _extend(tables, counts, tokens, bs):
    full = []
    at = 0
    for table, c in zip(tables, counts):
        tail = table.tail_tokens
        tail += tokens[at:at + c]
        at += c
        if len(tail) >= bs:
            full.append(table)
    return full


def _need(tables, counts, bs) -> int:
    return sum(-(-(t.num_tokens + c) // bs) - len(t.blocks) for t, c in zip(tables, counts))
