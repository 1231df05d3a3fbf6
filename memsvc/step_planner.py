"""Reserve: grant slots for one step in plan order, preempting from the tail when blocks run out."""
from __future__ import annotations

from dataclasses import dataclass, field

from memsvc.allocator import KVAllocator, NoFreeBlocks
from pagedserve.protocol import Grant, Plan, PlanEntry, Preemption, Rejection, ReserveResult


@dataclass
class Reservation:
    result: ReserveResult
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) blocks, in order


class StepPlanner:
    """Policy for one step; the allocator is the mechanism.

    Running sequences come first in a plan and are never refused for a new one: when a
    running sequence cannot grow, the running sequence latest in the plan (lowest priority,
    latest arrival) is preempted, possibly the one asking. New sequences are admitted in
    order until the first that does not fit now; later ones wait too (no overtaking).
    """

    def __init__(self, allocator: KVAllocator):
        self.allocator = allocator

    def reserve(self, plan: Plan) -> Reservation:
        alloc = self.allocator
        for seq_id in plan.free:
            if alloc.has_sequence(seq_id):
                alloc.free(seq_id)
        out = Reservation(ReserveResult(grants=[]))
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
            n = len(entry.token_ids)
            while not alloc.can_append(entry.seq_id, n):
                victim = self._pick_victim(entries, i, preempted)
                self._preempt(victim, out, preempted)
                if victim == entry.seq_id:
                    break
            if entry.seq_id in preempted:
                continue
            start = alloc.num_tokens(entry.seq_id)
            self._grant(entry, start, entry.token_ids, 0, out)
        return out

    def _admit(self, entry: PlanEntry, out: Reservation) -> bool:
        """Try to start a new sequence; False means it (and everything after it) waits."""
        alloc = self.allocator
        admission = alloc.admit(entry.token_ids, entry.max_len, entry.salt, final_len=entry.final_len)
        if admission.kind == "never":
            out.result.rejected.append(Rejection(entry.seq_id, admission.reason))
            return True
        if admission.kind == "wait":
            out.result.waiting.append(entry.seq_id)
            return False
        try:
            cached = alloc.add_sequence(
                entry.seq_id, entry.token_ids, max_len=entry.max_len,
                final_len=entry.final_len, salt=entry.salt,
            )
        except NoFreeBlocks:
            out.result.waiting.append(entry.seq_id)
            return False
        limit = entry.max_new_tokens or len(entry.token_ids)
        chunk = entry.token_ids[cached : cached + limit]
        if not chunk or not alloc.can_append(entry.seq_id, len(chunk)):
            alloc.free(entry.seq_id)
            out.result.waiting.append(entry.seq_id)
            return False
        self._grant(entry, cached, chunk, cached, out)
        return True

    def _grant(self, entry: PlanEntry, start: int, tokens: list[int], cached: int, out: Reservation) -> None:
        appended = self.allocator.append(entry.seq_id, tokens)
        out.copies.extend(appended.copies)
        out.result.grants.append(Grant(
            seq_id=entry.seq_id, start_pos=start, num_tokens=len(tokens),
            slot_mapping=appended.slot_mapping,
            block_table=self.allocator.block_table(entry.seq_id),
            num_cached_tokens=cached,
        ))

    @staticmethod
    def _pick_victim(entries: list[PlanEntry], current: int, preempted: set[str]) -> str:
        for entry in reversed(entries[current + 1 :]):
            if not entry.new and entry.seq_id not in preempted:
                return entry.seq_id
        return entries[current].seq_id

    def _preempt(self, seq_id: str, out: Reservation, preempted: set[str]) -> None:
        self.allocator.free(seq_id)
        preempted.add(seq_id)
        out.result.preempted.append(Preemption(seq_id, "recompute"))
