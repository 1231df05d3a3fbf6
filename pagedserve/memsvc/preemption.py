"""Preemption: which running sequence gives up its blocks when a running one cannot grow,
and how.

The victim is the running sequence latest in the plan (lowest priority, latest arrival)
that is neither preempted nor swapped out yet, else the one asking. Swap or recompute is
the PreemptionPolicy's choice (pagedserve.memsvc.preemption_policy): a swap-out's copies
join the Reservation's, in order; recompute frees the blocks. `PreemptionCounts` are
memsvc's stats. Called by pagedserve.memsvc.step_planner's per-sequence loop;
docs/ARCHITECTURE.md, "Prefix cache, sharing and preemption".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedserve.wire.reserve_messages import Preemption

if TYPE_CHECKING:
    from pagedserve.memsvc.step_planner import Reservation, StepPlanner


@dataclass
class PreemptionCounts:
    swapped_out: int = 0
    swapped_in: int = 0
    recomputed: int = 0
    swap_fallbacks: int = 0


def pick_victim(planner: StepPlanner, ids: list[str], current: int, preempted: set[str]) -> str:
    """The running sequence latest in the plan after `current`, not preempted nor
    swapped out; else the one at `current`."""
    for seq_id in reversed(ids[current + 1:]):
        if seq_id not in preempted and not planner.swapped(seq_id):
            return seq_id
    return ids[current]


def preempt(planner: StepPlanner, seq_id: str, out: Reservation, preempted: set[str]) -> None:
    alloc = planner.allocator
    preempted.add(seq_id)
    if planner.can_swap:
        blocks = len(alloc.block_table(seq_id))
        choice = planner.policy.choose(blocks, alloc.num_tokens(seq_id), alloc.can_swap_out(seq_id))
        planner.counts.swap_fallbacks += choice.fallback
        if choice.mode == "swap":
            out.copies.extend(("out", src, dst) for src, dst in alloc.swap_out(seq_id))
            planner.counts.swapped_out += 1
            out.result.preempted.append(Preemption(seq_id, "swap"))
            return
    alloc.free(seq_id)
    planner.counts.recomputed += 1
    out.result.preempted.append(Preemption(seq_id, "recompute"))
