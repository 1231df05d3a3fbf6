"""The tokens memsvc holds as pending: slots a plan made ahead reserved for a token whose id
the running step had not sampled yet (`PlanEntry.pending`). Their ids go to memsvc in a
later plan's `fills`, once known, so it can key the blocks they complete for the prefix
cache (docs/ARCHITECTURE.md, "The step path")."""
from __future__ import annotations

from gateway.sequence import Sequence
from wire.protocol import Plan


class PendingTokens:
    def __init__(self):
        self.positions: dict[str, int] = {}  # seq id -> position memsvc holds as pending

    def hold(self, seq_id: str, position: int) -> None:
        self.positions[seq_id] = position

    def drop(self, seq_id: str) -> None:
        """memsvc no longer holds the sequence's blocks (preempted for recompute)."""
        self.positions.pop(seq_id, None)

    def deferred(self, plan: Plan) -> None:
        """memsvc did not grant `plan`: it holds none of its pending tokens."""
        for entry in plan.entries:
            if entry.pending:
                self.positions.pop(entry.seq_id, None)

    def take_fills(self, seqs: dict[str, Sequence]) -> list[tuple[str, int, int]]:
        """(seq_id, position, token_id) of the pending tokens whose ids are known now;
        sequences gone since are skipped (memsvc frees them)."""
        fills, later = [], {}
        for seq_id, pos in self.positions.items():
            seq = seqs.get(seq_id)
            if seq is None:
                continue
            if pos < seq.num_tokens:
                fills.append((seq_id, pos, seq.output_token_ids[pos - len(seq.prompt_token_ids)]))
            else:
                later[seq_id] = pos  # its step failed: the state is dropped or recomputed
        self.positions = later
        return fills
