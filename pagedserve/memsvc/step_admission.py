"""Letting a sequence into a step: a new one (admission, after its cached prefix) or a
swapped-out one coming back (resumption, by swap-in).

Each answers False, holding nothing, where the sequence does not fit now; the planner then
lets nothing later in the plan in (no overtaking). Both keep the planner's
`watermark_blocks` free while other sequences hold blocks, so a sequence let in is not
preempted at the next step. A new sequence that can never fit is rejected with the limit it
exceeds. Called by pagedserve.memsvc.step_planner in plan order; docs/ARCHITECTURE.md,
"One step".
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from pagedserve.memsvc.allocator import NoFreeBlocks
from pagedserve.memsvc.block_table import blocks_for
from pagedserve.wire.reserve_messages import PlanEntry, Rejection

if TYPE_CHECKING:
    from pagedserve.memsvc.step_planner import Reservation, StepPlanner


def admit(planner: StepPlanner, entry: PlanEntry, out: Reservation) -> bool:
    """Try to start a new sequence; False means it (and everything after it) waits."""
    alloc = planner.allocator
    admission = alloc.admit(entry.token_ids, entry.max_len, entry.salt, final_len=entry.final_len,
                            use_cache=not entry.skip_prefix_cache)
    if admission.kind == "never":
        out.result.rejected.append(Rejection(entry.seq_id, admission.reason))
        return True
    if admission.kind == "wait":
        out.result.waiting.append(entry.seq_id)
        return False
    busy = alloc.num_free_blocks() < alloc.num_blocks
    try:
        cached = alloc.add_sequence(
            entry.seq_id, entry.token_ids, max_len=entry.max_len,
            final_len=entry.final_len, salt=entry.salt, use_cache=not entry.skip_prefix_cache,
        )
    except NoFreeBlocks:
        out.result.waiting.append(entry.seq_id)
        return False
    out.copies.extend(alloc.take_copies())  # restores of its prefix, after what they evicted
    limit = entry.max_new_tokens or len(entry.token_ids)
    chunk = entry.token_ids[cached : cached + limit]
    watermark = planner.watermark_blocks if busy else 0
    if not chunk or alloc.num_new_blocks(entry.seq_id, len(chunk)) + watermark > alloc.num_free_blocks():
        alloc.free(entry.seq_id)
        out.result.waiting.append(entry.seq_id)
        return False
    _grant(planner, entry.seq_id, cached, chunk, cached, out)
    return True


def resume(planner: StepPlanner, seq_id: str, tokens: list[int], out: Reservation) -> bool:
    """Swap a sequence back in and grant its tokens; False (nothing changed) if no room."""
    alloc = planner.allocator
    start = alloc.num_tokens(seq_id)
    if not _room(planner, blocks_for(start + len(tokens), alloc.block_size)):
        return False
    pairs = alloc.swap_in(seq_id)
    out.copies.extend(alloc.take_copies())  # offloads of blocks the swap-in evicted first
    out.copies.extend(("in", src, dst) for src, dst in pairs)
    planner.counts.swapped_in += 1
    out.result.resumed.append(seq_id)
    _grant(planner, seq_id, start, tokens, 0, out)
    return True


def _room(planner: StepPlanner, blocks: int) -> bool:
    """`blocks` more fit, leaving the watermark free when other sequences hold blocks."""
    alloc = planner.allocator
    free = alloc.num_free_blocks()
    busy = free < alloc.num_blocks
    return blocks + (planner.watermark_blocks if busy else 0) <= free


def _grant(planner: StepPlanner, seq_id: str, start: int, tokens: list[int], cached: int,
           out: Reservation) -> None:
    alloc = planner.allocator
    cow = alloc.grow(seq_id, tokens)
    out.copies.extend(alloc.take_copies())
    if cow:
        out.copies.extend(("cow", src, dst) for src, dst in cow)
    out.result.grants.add(seq_id, start, len(tokens), *alloc.table_changes(seq_id), cached)
