"""Reserve: grant slots for one step in plan order, preempting from the tail when blocks run out.

StepPlanner grants the running sequences in one pass where none needs a decision
(`grow_running`, pagedserve.memsvc.running_growth), else one at a time (`grow_each`,
pagedserve.memsvc.running_each, the reference), preempting as pagedserve.memsvc.preemption decides; then it lets swapped-out
and new sequences in (pagedserve.memsvc.step_admission). docs/ARCHITECTURE.md, "One step".
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.memsvc.allocator import KVAllocator, RunGrowth
from pagedserve.memsvc.preemption import PreemptionCounts
from pagedserve.memsvc.preemption_policy import PreemptionPolicy
from pagedserve.memsvc.running_each import fits_as_is, grow_each
from pagedserve.memsvc.steady_fills import SteadyFills
from pagedserve.memsvc.steady_fills import apply as apply_fills
from pagedserve.memsvc.step_admission import admit
from pagedserve.wire.pending_token import PENDING
from pagedserve.wire.reserve_messages import Plan, ReserveResult

# pool -> pool, pool -> swap space, swap space -> pool, pool -> host tier, host tier -> pool
COPY_KINDS = ("cow", "out", "in", "offload", "restore")


def check_plan(plan: Plan) -> None:
    """ValueError for what a plan made ahead may not do (fork), PENDING tokens elsewhere, and
    running columns that do not agree."""
    if plan.ahead and plan.forks:
        raise ValueError("a plan made ahead cannot fork: send its forks once the step is done")
    if len(plan.run_counts) != len(plan.run_ids) or sum(plan.run_counts) != len(plan.run_tokens):
        raise ValueError("run_ids, run_counts and run_tokens do not agree")
    if (not plan.ahead and PENDING in plan.run_tokens) or any(PENDING in e.token_ids for e in plan.entries):
        raise ValueError("only running sequences of a plan made ahead may have a pending token "
                         "(pagedserve.wire.pending_token.PENDING)")


@dataclass
class Reservation:
    """`copies`: (kind, src, dst) block copies in the order decided; the caller performs
    them in that order (a block freed by a swap-out may be the target of a later copy)."""

    result: ReserveResult
    copies: list[tuple[str, int, int]] = field(default_factory=list)


class StepPlanner:
    """Policy for one step; the allocator is the mechanism.

    Plan order is priority order: running sequences, then swapped-out ones to resume, then
    new ones. A running sequence is never refused for a later one: when it cannot grow,
    the running sequence latest in the plan (lowest priority, latest arrival) is preempted,
    possibly the one asking, by swap or recompute as the PreemptionPolicy chooses. Swapped
    sequences come back in order before any new one is admitted; the first that does not
    fit stops resumption and admission (no overtaking). Admission and resumption keep
    `watermark_blocks` free while other sequences hold blocks, so a sequence let in is not
    preempted at the next step.

    A plan made ahead (`Plan.ahead`, the previous step still running) is granted only when
    every running entry fits without a copy or a preemption (after its frees); otherwise
    the answer is `deferred` and nothing but the frees happened.
    """

    def __init__(self, allocator: KVAllocator, policy: PreemptionPolicy | None = None,
                 watermark_blocks: int = 0):
        if watermark_blocks < 0:
            raise ValueError(f"watermark_blocks must be >= 0, got {watermark_blocks}")
        self.allocator = allocator
        self.policy = policy or PreemptionPolicy("recompute")
        self.watermark_blocks = watermark_blocks
        self.counts = PreemptionCounts()
        self.can_swap = allocator.supports_swap

    def reserve(self, plan: Plan, fills: SteadyFills | None = None, checked: bool = False) -> Reservation:
        """`fills`: the plan's fills, checked (pagedserve.memsvc.steady_fills), where the
        caller left them to the running growth. `checked`: the caller ran `check_plan`."""
        alloc = self.allocator
        if not checked:
            check_plan(plan)
        for parent, child in plan.forks:
            alloc.fork(parent, child)
        self.free(plan.free)
        out = Reservation(ReserveResult())
        ids, counts = plan.run_ids, plan.run_counts
        grown = alloc.grow_running(ids, counts, plan.run_tokens, fills) if ids else None
        if grown is None and fills is not None:
            apply_fills(alloc, fills)
        if grown is not None:  # every one fits as is: what the loop below would do
            self._add_running(out, ids, counts, grown)
            admitting = True
        elif plan.ahead and not fits_as_is(alloc, ids, counts):
            out.result.deferred = True
            return out
        else:
            admitting = grow_each(self, plan, out)
        for entry in plan.entries:
            if admitting:
                admitting = admit(self, entry, out)
            else:
                out.result.waiting.append(entry.seq_id)
        return out

    def _add_running(self, out: Reservation, ids: list[str], counts: list[int], grown: RunGrowth) -> None:
        starts, table_starts, num_new, new_blocks = grown
        g = out.result.grants
        g.seq_ids += ids
        g.start_pos += starts
        g.num_tokens += counts
        g.table_start += table_starts
        g.num_new_blocks += num_new
        g.new_blocks += new_blocks
        g.num_cached += [0] * len(ids)
        out.copies += self.allocator.take_copies()  # a host tier's offloads of what it evicted

    def free(self, seq_ids: list[str]) -> None:
        """Release the sequences' blocks (one memsvc no longer holds is skipped)."""
        alloc = self.allocator
        for seq_id in seq_ids:
            if alloc.has_sequence(seq_id):
                alloc.free(seq_id)

    def swapped(self, seq_id: str) -> bool:
        return self.can_swap and self.allocator.is_swapped(seq_id)
