"""Reserve: grant slots for one step in plan order, preempting from the tail when blocks run out.

StepPlanner grants the running sequences in one pass where none needs a decision
(`grow_running`, pagedserve.memsvc.running_growth), else one at a time (`_grow_each`, the
reference), preempting as pagedserve.memsvc.preemption decides; then it lets swapped-out
and new sequences in (pagedserve.memsvc.step_admission). docs/ARCHITECTURE.md, "One step".
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.memsvc.allocator import KVAllocator, RunGrowth
from pagedserve.memsvc.preemption import PreemptionCounts, pick_victim, preempt
from pagedserve.memsvc.preemption_policy import PreemptionPolicy
from pagedserve.memsvc.steady_fills import SteadyFills
from pagedserve.memsvc.steady_fills import apply as apply_fills
from pagedserve.memsvc.step_admission import admit, resume
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
        elif plan.ahead and not self._fits_as_is(zip(ids, counts)):
            out.result.deferred = True
            return out
        else:
            admitting = self._grow_each(plan, out)
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

    def _grow_each(self, plan: Plan, out: Reservation) -> bool:
        """Grant the running sequences one at a time, preempting from the tail; False when a
        swapped one could not resume (then nothing new is admitted)."""
        alloc = self.allocator
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
                if self._swapped(seq_id):
                    admitting = admitting and resume(self, seq_id, new_tokens, out)
                    continue
                while not alloc.can_append(seq_id, n):
                    victim = pick_victim(self, ids, i, preempted)
                    preempt(self, victim, out, preempted)
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

    def free(self, seq_ids: list[str]) -> None:
        """Release the sequences' blocks (one memsvc no longer holds is skipped)."""
        alloc = self.allocator
        for seq_id in seq_ids:
            if alloc.has_sequence(seq_id):
                alloc.free(seq_id)

    def _fits_as_is(self, growths) -> bool:
        """Each (seq_id, new tokens) grows with no copy: held, not swapped out, no
        copy-on-write; and all of them within the free blocks."""
        alloc = self.allocator
        need = 0
        for seq_id, n in growths:
            blocks = alloc.growth_as_is(seq_id, n)
            if blocks is None:
                return False
            need += blocks
        return need <= alloc.num_free_blocks()

    def _swapped(self, seq_id: str) -> bool:
        return self.can_swap and self.allocator.is_swapped(seq_id)
