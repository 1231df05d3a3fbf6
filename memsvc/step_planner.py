"""Reserve: grant slots for one step in plan order, preempting from the tail when blocks run out."""
from __future__ import annotations

from dataclasses import dataclass, field

from memsvc.allocator import Growth, KVAllocator, NoFreeBlocks
from memsvc.block_table import blocks_for
from memsvc.preemption_policy import PreemptionPolicy
from wire.pending_token import PENDING
from wire.protocol import (
    Grant,
    Plan,
    PlanEntry,
    Preemption,
    Rejection,
    ReserveResult,
    RunGrants,
)

# pool -> pool, pool -> swap space, swap space -> pool, pool -> host tier, host tier -> pool
COPY_KINDS = ("cow", "out", "in", "offload", "restore")


def check_plan(plan: Plan) -> None:
    """ValueError for what a plan made ahead may not do (fork) and pending tokens elsewhere."""
    if plan.ahead and plan.forks:
        raise ValueError("a plan made ahead cannot fork: send its forks once the step is done")
    if any(e.pending and (e.new or not plan.ahead) for e in plan.entries):
        raise ValueError("only running entries of a plan made ahead may have a pending token")


@dataclass
class Reservation:
    """`copies`: (kind, src, dst) block copies in the order decided; the caller performs
    them in that order (a block freed by a swap-out may be the target of a later copy)."""

    result: ReserveResult
    copies: list[tuple[str, int, int]] = field(default_factory=list)


@dataclass
class PreemptionCounts:
    swapped_out: int = 0
    swapped_in: int = 0
    recomputed: int = 0
    swap_fallbacks: int = 0


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

    def reserve(self, plan: Plan) -> Reservation:
        alloc = self.allocator
        check_plan(plan)
        for parent, child in plan.forks:
            alloc.fork(parent, child)
        self.free(plan.free)
        out = Reservation(ReserveResult(grants=[]))
        if plan.ahead and not self._fits_ahead(plan.entries):
            out.result.deferred = True
            return out
        preempted: set[str] = set()
        admitting = True
        entries = plan.entries
        for i, entry in enumerate(entries):
            if entry.seq_id in preempted:
                continue
            if entry.new:
                if admitting and not self._admit(entry, out):
                    admitting = False
                elif not admitting:
                    out.result.waiting.append(entry.seq_id)
                continue
            tokens = entry.token_ids + [PENDING] * entry.pending
            grown = alloc.grow_if_fits(entry.seq_id, tokens)
            out.copies.extend(alloc.take_copies())
            if grown is None:  # swapped out, or short of blocks
                if self._swapped(entry.seq_id):
                    admitting = admitting and self._resume(entry, out)
                    continue
                while not alloc.can_append(entry.seq_id, len(tokens)):
                    victim = self._pick_victim(entries, i, preempted)
                    self._preempt(victim, out, preempted)
                    if victim == entry.seq_id:
                        break
                if entry.seq_id in preempted:
                    continue
                grown = alloc.grow_if_fits(entry.seq_id, tokens)
                out.copies.extend(alloc.take_copies())
            self._add_grant(entry, len(tokens), grown, 0, out)
        return out

    def free(self, seq_ids: list[str]) -> None:
        """Release the sequences' blocks (one memsvc no longer holds is skipped)."""
        alloc = self.allocator
        for seq_id in seq_ids:
            if alloc.has_sequence(seq_id):
                alloc.free(seq_id)

    def reserve_running(self, free: list[str], seq_ids: list[str], counts: list[int],
                        token_ids: list[int], pending: list[int]) -> RunGrants | None:
        """What `reserve` grants a plan made ahead whose entries are all running, in columns:
        `free` first, then sequence i computes `counts[i]` tokens of `token_ids` and, where
        `pending[i]`, one more. None: deferred (nothing changed but the frees)."""
        alloc = self.allocator
        self.free(free)
        if not self._fits_as_is((s, n + p) for s, n, p in zip(seq_ids, counts, pending)):
            return None
        out, grow, at = RunGrants(), alloc.grow_if_fits, 0
        starts, table_starts, num_new, new_blocks = out.start_pos, out.table_start, out.num_new_blocks, out.new_blocks
        for seq_id, n, p in zip(seq_ids, counts, pending):
            tokens = token_ids[at:at + n]
            at += n
            if p:
                tokens.append(PENDING)
            start, _, table_start, blocks = grow(seq_id, tokens)  # fits, without a copy: checked
            starts.append(start)
            table_starts.append(table_start)
            num_new.append(len(blocks))
            new_blocks.extend(blocks)
        out.copies = alloc.take_copies()
        return out

    def _fits_ahead(self, entries: list[PlanEntry]) -> bool:
        """Every running entry of a plan made ahead fits as it is (`_fits_as_is`); new
        entries only after them."""
        k = next((i for i, e in enumerate(entries) if e.new), len(entries))
        if not all(e.new for e in entries[k:]):
            return False
        return self._fits_as_is((e.seq_id, len(e.token_ids) + e.pending) for e in entries[:k])

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

    def _room(self, blocks: int) -> bool:
        """`blocks` more fit, leaving the watermark free when other sequences hold blocks."""
        alloc = self.allocator
        free = alloc.num_free_blocks()
        busy = free < alloc.num_blocks
        return blocks + (self.watermark_blocks if busy else 0) <= free

    def _admit(self, entry: PlanEntry, out: Reservation) -> bool:
        """Try to start a new sequence; False means it (and everything after it) waits."""
        alloc = self.allocator
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
        watermark = self.watermark_blocks if busy else 0
        if not chunk or alloc.num_new_blocks(entry.seq_id, len(chunk)) + watermark > alloc.num_free_blocks():
            alloc.free(entry.seq_id)
            out.result.waiting.append(entry.seq_id)
            return False
        self._grant(entry, cached, chunk, cached, out)
        return True

    def _resume(self, entry: PlanEntry, out: Reservation) -> bool:
        """Swap a sequence back in and grant its tokens; False (nothing changed) if no room."""
        alloc = self.allocator
        start = alloc.num_tokens(entry.seq_id)
        if not self._room(blocks_for(start + len(entry.token_ids), alloc.block_size)):
            return False
        pairs = alloc.swap_in(entry.seq_id)
        out.copies.extend(alloc.take_copies())  # offloads of blocks the swap-in evicted first
        out.copies.extend(("in", src, dst) for src, dst in pairs)
        self.counts.swapped_in += 1
        out.result.resumed.append(entry.seq_id)
        self._grant(entry, start, entry.token_ids, 0, out)
        return True

    def _grant(self, entry: PlanEntry, start: int, tokens: list[int], cached: int, out: Reservation) -> None:
        copies = self.allocator.grow(entry.seq_id, tokens)
        out.copies.extend(self.allocator.take_copies())
        self._add_grant(entry, len(tokens), (start, copies, *self.allocator.table_changes(entry.seq_id)),
                        cached, out)

    @staticmethod
    def _add_grant(entry: PlanEntry, num_tokens: int, grown: Growth, cached: int, out: Reservation) -> None:
        """Record a growth of `num_tokens` as a Grant, and its copies."""
        start, copies, table_start, new_blocks = grown
        if copies:
            out.copies.extend(("cow", src, dst) for src, dst in copies)
        out.result.grants.append(Grant(entry.seq_id, start, num_tokens, table_start, new_blocks, cached))

    def _pick_victim(self, entries: list[PlanEntry], current: int, preempted: set[str]) -> str:
        for entry in reversed(entries[current + 1 :]):
            if not entry.new and entry.seq_id not in preempted and not self._swapped(entry.seq_id):
                return entry.seq_id
        return entries[current].seq_id

    def _preempt(self, seq_id: str, out: Reservation, preempted: set[str]) -> None:
        alloc = self.allocator
        preempted.add(seq_id)
        if self.can_swap:
            blocks = len(alloc.block_table(seq_id))
            choice = self.policy.choose(blocks, alloc.num_tokens(seq_id), alloc.can_swap_out(seq_id))
            self.counts.swap_fallbacks += choice.fallback
            if choice.mode == "swap":
                out.copies.extend(("out", src, dst) for src, dst in alloc.swap_out(seq_id))
                self.counts.swapped_out += 1
                out.result.preempted.append(Preemption(seq_id, "swap"))
                return
        alloc.free(seq_id)
        self.counts.recomputed += 1
        out.result.preempted.append(Preemption(seq_id, "recompute"))
