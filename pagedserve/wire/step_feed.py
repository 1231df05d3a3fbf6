"""The executor feeds itself: a step may name a decode token as "the one you sampled last".

The gateway sends step N + 1 while step N runs (docs/ARCHITECTURE.md, "The step path"):
a sequence whose next input is the token step N samples goes with `token_ids == [PENDING]`.
Whoever runs the steps keeps each sequence's last sample (`LastSampled.record`) and puts
it in place just before the step runs (`fill`); a fed token it does not hold (the step
before failed, the executor restarted) raises FedTokenUnknown and nothing runs, so the
gateway sends the step again with the token it now knows. A sequence the executor left
out of a step (it reported an error: pagedserve.executor.seq_screen) has no sample: the steps sent
behind it leave it out too, with the same reason. `StepOrder` runs one caller's
steps in the order it numbered them (`StepBatch.step`), as two in flight may arrive in
either order. pagedserve.wire.ordered_executor does both around an in-process executor.
"""
from __future__ import annotations

import threading

from pagedserve.wire.pending_token import PENDING
from pagedserve.wire.protocol import SampleOutput, StepBatch

FED_UNKNOWN = "fed token unknown"  # in FAILED_PRECONDITION details: send the step's tokens
ORDER_WAIT_S = 1.0  # how long a step waits for an earlier-numbered one that has not come


class FedTokenUnknown(LookupError):
    """A step names a sequence's last sample that this executor does not hold."""


def lost_feed(error: BaseException) -> bool:
    """Whether a failed step failed only for want of a fed token (in process, or across the
    wire: FAILED_PRECONDITION saying so, or that the executor lost every state)."""
    if isinstance(error, FedTokenUnknown):
        return True
    details = error.details() if callable(getattr(error, "details", None)) else ""
    return FED_UNKNOWN in (details or "") or "executor state lost" in (details or "")


class LastSampled:
    """seq id -> (position, token) of its last sampled token; seq id -> why it was left out."""

    def __init__(self):
        self.last: dict[str, tuple[int, int]] = {}
        self.left_out: dict[str, str] = {}

    def fill(self, batch: StepBatch) -> list[int]:
        """Put each fed token in place (token_ids, and output_token_ids when it ends with
        PENDING); the indices of the fed sequences. FedTokenUnknown before any change."""
        last = self.last
        fed = [i for i, s in enumerate(batch.seqs) if s.token_ids and s.token_ids[0] == PENDING]
        if self.left_out:
            for i in [i for i in fed if batch.seqs[i].seq_id in self.left_out]:
                s = batch.seqs[i]
                s.error = f"left out of an earlier step: {self.left_out[s.seq_id]}"
                s.token_ids[0] = 0
                fed.remove(i)
        for i in fed:
            s = batch.seqs[i]
            pos_token = last.get(s.seq_id)
            if pos_token is None or pos_token[0] != s.start_pos:
                raise FedTokenUnknown(f"{FED_UNKNOWN}: sequence {s.seq_id!r} at position "
                                      f"{s.start_pos}: send its token")
        for i in fed:
            s = batch.seqs[i]
            token = last[s.seq_id][1]
            s.token_ids[0] = token
            out = s.output_token_ids
            if out and out[-1] == PENDING:
                out[-1] = token
        return fed

    def record(self, batch: StepBatch, outputs: list[SampleOutput]) -> None:
        """Keep what `batch` sampled (its outputs: one per sequence that reports)."""
        for seq_id in batch.forget:
            self.last.pop(seq_id, None)
            self.left_out.pop(seq_id, None)
        at = 0
        last = self.last
        for s in batch.seqs:
            if not s.reports:
                continue
            out = outputs[at]
            at += 1
            if out.error:
                self.left_out[s.seq_id] = out.error
                last.pop(s.seq_id, None)
            elif s.sample and out.sampled:
                last[s.seq_id] = (s.start_pos + len(s.token_ids), out.token_id)


class StepOrder:
    """Steps numbered 1, 2, ... by one caller go through `wait_turn` in that order: step k
    waits until k - 1 has been let through (`passed`), at most `wait_s`; a number at or
    below one already let through (a retry) or 0 (unordered) goes at once. `joined`: the
    caller numbered steps before this object existed (a restarted executor), so the first
    step heard of goes at once."""

    def __init__(self, wait_s: float = ORDER_WAIT_S, joined: bool = False):
        self.wait_s = wait_s
        self.joined = joined
        self.last = 0
        self._cond = threading.Condition()

    def wait_turn(self, step: int) -> None:
        if step <= 0:
            return
        with self._cond:
            if self.last == 0 and self.joined:
                return
            self._cond.wait_for(lambda: self.last >= step - 1, self.wait_s)

    def passed(self, step: int) -> None:
        with self._cond:
            if step > self.last:
                self.last = step
                self._cond.notify_all()
