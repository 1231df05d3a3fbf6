"""The step of every running sequence of a plan at once: a paged allocator's fast path.

`grow_running` gives exactly what `grow_if_fits` would give each sequence in plan order
(the reference), in the common case where that needs no decision: every sequence is held
on the device, none may copy its last block, and their new blocks all fit among the free
ones (then none is refused or preempted, and allocating in plan order hands out the same
blocks). With a sliding window, a step that releases blocks must take none (one at a time,
a later sequence could be handed a block an earlier one released). Otherwise it changes
nothing and answers None: the caller goes one sequence at a time.

Check, then act: the check counts blocks sequence by sequence only where the free ones
are too few for the most the step could take, or a window releases some; the act is a
few plain passes over the sequences (counts, sync marks, tokens; in a one-token step one
loop, which also applies the step's checked fills, pagedserve.memsvc.steady_fills), then
work one by one only for the sequences that take a block, fill one, or whose table the
gateway has not been told in full.
"""
from __future__ import annotations

from pagedserve.memsvc.allocator import RunGrowth
from pagedserve.memsvc.sequence_fork import may_copy
from pagedserve.memsvc.steady_fills import SteadyFills
from pagedserve.memsvc.steady_fills import apply as apply_fills
from pagedserve.wire.pending_token import PENDING


def grow_running(alloc, seq_ids: list[str], counts: list[int], tokens: list[int],
                 fills: SteadyFills | None = None) -> RunGrowth | None:
    """`alloc`: the PagedAllocator (this is its own code, split out). `tokens`: every
    sequence's new tokens, `counts[i]` of them for `seq_ids[i]`, in order. `fills`: these
    sequences' checked fills (pagedserve.memsvc.steady_fills), applied first where this
    acts; where it answers None the caller applies them."""
    n = len(seq_ids)
    if fills is None:
        tables = list(map(alloc._seqs.get, seq_ids))
        if not all(tables) or True in [t.swapped for t in tables]:
            return None
    else:
        tables = fills.tables
    if alloc.shared_tails and may_copy(alloc):
        return None
    bs, pool = alloc.block_size, alloc.pool
    ones = len(tokens) == n and counts.count(1) == n
    most = n if ones else n + -(-len(tokens) // bs)  # blocks_for(nt + c) - blocks_for(nt) <= ceil(c / bs)
    releasing = _releasing(tables, alloc.window, bs) if alloc.window is not None else ()
    if (most > pool.num_free or releasing) and _need(tables, counts, bs) > (0 if releasing else pool.num_free):
        return None
    # -- act: nothing has changed so far --
    if fills is not None and releasing:  # fills first, as the reference: a release may free a block one keys
        apply_fills(alloc, fills)
        fills = None
    for table in releasing:
        alloc._release_outside_window(table)
    starts = [t.num_tokens for t in tables] if fills is None else fills.starts
    synced = [t.synced for t in tables]
    full = []  # tables whose tail holds a block's worth of tokens: keyed once their blocks are in
    if ones:
        stale = []  # tables the gateway does not have as they are now: those taking a block among them
        caching, key = alloc.enable_prefix_caching, alloc._key_tail
        filled = fills.token_ids if fills is not None else ()
        i = 0
        for table, token in zip(tables, tokens):
            nt = table.num_tokens
            table.num_tokens = nt + 1
            if table.synced != nt // bs + 1:
                stale.append(i)
            if caching:
                tail = table.tail_tokens
                if filled:  # (steady_fills.apply, inline)
                    tail[-1] = filled[i]
                    if len(tail) == bs:
                        key(table)
                tail.append(token)
                if len(tail) >= bs and (len(tail) > bs or token != PENDING):  # (else its pending token holds the block back)
                    full.append(table)
            i += 1
        grow = [(i, 1) for i in stale if not starts[i] % bs]
    else:
        if fills is not None:
            apply_fills(alloc, fills)
        for table, c in zip(tables, counts):
            table.num_tokens += c
        grow = [(i, k) for i, t in enumerate(tables) if (k := -(-t.num_tokens // bs) - len(t.blocks))]
        stale = [i for i, (s, t) in enumerate(zip(synced, tables)) if s != -(-t.num_tokens // bs)]
        if alloc.enable_prefix_caching:
            at = 0
            for table, c in zip(tables, counts):
                tail = table.tail_tokens
                tail += tokens[at:at + c]
                at += c
                if len(tail) >= bs:
                    full.append(table)
    if grow:
        fresh = pool.allocate(sum(k for _, k in grow))
        at = 0
        for i, k in grow:
            tables[i].blocks += fresh[at:at + k]
            at += k
    for table in full:
        alloc._key_tail(table)
    num_new = [0] * n
    new_blocks: list[int] = []
    for i in stale:
        table = tables[i]
        if synced[i] == len(table.blocks) - 1:  # the last block alone (never a released one)
            table.synced += 1
            num_new[i] = 1
            new_blocks.append(table.blocks[-1].block_id)
        else:
            _, blocks = alloc._table_changes(table)
            num_new[i] = len(blocks)
            new_blocks += blocks
    return starts, synced, num_new, new_blocks


def _need(tables, counts, bs) -> int:
    return sum(-(-(t.num_tokens + c) // bs) - len(t.blocks) for t, c in zip(tables, counts))


def _releasing(tables, window: int, bs: int) -> list:
    """The tables whose growth first frees blocks that left the window (as
    PagedAllocator._release_outside_window decides), in order."""
    return [t for t in tables if min(max(t.num_tokens - window + 1, 0) // bs, len(t.blocks) - 1) > t.released]
