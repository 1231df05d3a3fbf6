"""The tokens memsvc holds as PENDING (pagedserve.wire.pending_token): slots a plan made ahead reserved
for a token whose id the running step had not sampled yet. Their ids go to memsvc in a
later plan's `fills`, once known, so it can key the blocks they complete for the prefix
cache (docs/ARCHITECTURE.md, "The step path"). A steady decode step holds one per running
sequence: `hold_all` keeps them as they came, in columns, until something asks for one."""
from __future__ import annotations

from pagedserve.gateway.sequence import Sequence
from pagedserve.wire.reserve_messages import Fills


class PendingTokens:
    def __init__(self):
        self._positions: dict[str, int] = {}
        self._columns: tuple[list[str], list[int]] | None = None  # held by hold_all, not in _positions
        self.planned: list[str] = []  # the sequences the last plan sent a PENDING token for

    @property
    def positions(self) -> dict[str, int]:
        """seq id -> position memsvc holds as pending."""
        if self._columns is not None:
            self._positions.update(zip(*self._columns))
            self._columns = None
        return self._positions

    def hold(self, seq_id: str, position: int) -> None:
        self.positions[seq_id] = position
        self.planned.append(seq_id)

    def hold_all(self, seq_ids: list[str], positions: list[int]) -> None:
        """`hold` of each sequence of `seq_ids` at its position of `positions`."""
        if self._positions or self._columns is not None:
            self.positions.update(zip(seq_ids, positions))
        else:
            self._columns = list(seq_ids), positions
        self.planned += seq_ids

    def take_known(self, seq_ids: list[str], positions: list[int], tokens: list[int]) -> Fills | None:
        """`take_fills` where the caller knows the pending tokens' ids: the pending tokens are
        exactly those of `seq_ids` at `positions`, in that order, their ids `tokens`. None,
        nothing done, where the pending tokens are others."""
        columns = self._columns
        if columns is not None and not self._positions:
            if columns[0] != seq_ids or columns[1] != positions:
                return None
        else:
            held = self.positions
            if len(held) != len(seq_ids) or list(held) != seq_ids or list(held.values()) != positions:
                return None
        self._positions, self._columns, self.planned = {}, None, []
        return Fills(list(seq_ids), list(positions), list(tokens))

    def drop(self, seq_id: str) -> None:
        """memsvc no longer holds the sequence's blocks (preempted for recompute)."""
        self.positions.pop(seq_id, None)

    def deferred(self) -> None:
        """memsvc did not grant the last plan: it holds none of its PENDING tokens."""
        positions = self.positions
        for seq_id in self.planned:
            positions.pop(seq_id, None)
        self.planned = []

    def take_fills(self, seqs: dict[str, Sequence]) -> Fills:
        """The pending tokens whose ids are known now; sequences gone since are skipped
        (memsvc frees them)."""
        fills, later = Fills(), {}
        get = seqs.get
        for seq_id, pos in self.positions.items():
            seq = get(seq_id)
            if seq is None:
                continue
            at = pos - len(seq.prompt_token_ids)  # in the output: pos >= the prompt's length
            out = seq.output_token_ids
            if at < len(out):
                fills.seq_ids.append(seq_id)
                fills.positions.append(pos)
                fills.token_ids.append(out[at])
            else:
                later[seq_id] = pos  # its step failed: the state is dropped or recomputed
        self._positions, self.planned = later, []
        return fills
