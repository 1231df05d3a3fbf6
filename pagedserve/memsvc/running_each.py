"""A step's running sequences granted one at a time, preempting from the tail as
pagedserve.memsvc.preemption decides: StepPlanner's general path and the reference its
one-pass growth (pagedserve.memsvc.running_growth) is tested against; and whether a plan made
ahead fits as it is. docs/ARCHITECTURE.md, "One step".
"""
from __future__ import annotations

from pagedserve.memsvc.preemption import pick_victim, preempt
from pagedserve.memsvc.step_admission import resume
from pagedserve.wire.reserve_messages import Plan


def grow_each(planner, plan: Plan, out) -> bool:
    """Grant `plan`'s running sequences one at a time onto `out` (a step_planner.Reservation),
    preempting from the tail; False when a swapped one could not resume (then nothing new
    is admitted). `planner`: the StepPlanner."""
    alloc = planner.allocator
    ids, counts = plan.run_ids, plan.run_counts
    preempted: set[str] = set()
    admitting = True
    grants, copies = out.result.grants, out.copies
    grow, take_copies = alloc.grow_if_fits, alloc.take_copies
    tier = getattr(alloc, "offload", None) is not None  # only a host tier's copies come unasked
    granted, starts, granted_n = grants.seq_ids, grants.start_pos, grants.num_tokens
    table_starts, num_new, new_blocks, cached = (grants.table_start, grants.num_new_blocks,
                                                 grants.new_blocks, grants.num_cached)
    tokens, at = plan.run_tokens, 0
    for i, seq_id in enumerate(ids):
        n = counts[i]
        new_tokens = tokens[at:at + n]
        at += n
        if seq_id in preempted:
            continue
        grown = grow(seq_id, new_tokens)
        if tier:
            copies += take_copies()
        if grown is None:  # swapped out, or short of blocks
            if planner.swapped(seq_id):
                admitting = admitting and resume(planner, seq_id, new_tokens, out)
                continue
            while not alloc.can_append(seq_id, n):
                victim = pick_victim(planner, ids, i, preempted)
                preempt(planner, victim, out, preempted)
                if victim == seq_id:
                    break
            if seq_id in preempted:
                continue
            grown = grow(seq_id, new_tokens)
            copies += take_copies()
        start, cow, table_start, blocks = grown
        if cow:
            copies.extend(("cow", src, dst) for src, dst in cow)
        granted.append(seq_id)  # (Grants.add, inline: this loop runs for every sequence)
        starts.append(start)
        granted_n.append(n)
        table_starts.append(table_start)
        num_new.append(len(blocks))
        new_blocks += blocks
        cached.append(0)
    return admitting


def fits_as_is(alloc, ids: list[str], counts: list[int]) -> bool:
    """Each sequence grows by its count with no copy: held, not swapped out, no
    copy-on-write; and all of them within the free blocks."""
    need = 0
    for seq_id, n in zip(ids, counts):
        blocks = alloc.growth_as_is(seq_id, n)
        if blocks is None:
            return False
        need += blocks
    return need <= alloc.num_free_blocks()
