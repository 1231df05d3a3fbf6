"""The executor feeds itself: a step may name a decode token as "the one you sampled last".

The gateway sends step N + 1 while step N runs (docs/ARCHITECTURE.md, "The step path"):
a sequence whose next input is the token step N samples goes with `token_ids == [PENDING]`.
Whoever runs the steps keeps each sequence's last sample and puts it in place just before
the step runs (pagedserve.step.running_set); a fed token it does not hold (the step
before failed, the executor restarted) raises FedTokenUnknown and nothing runs, so the
gateway sends the step again with the token it now knows. A sequence the executor left
out of a step (it reported an error: pagedserve.executor.seq_screen) has no sample: the steps sent
behind it leave it out too, with the same reason. `StepOrder` runs one caller's
steps in the order it numbered them (`step`), as two in flight may arrive in either order.
"""
from __future__ import annotations

import threading


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


class StepOrder:
    """Steps numbered 1, 2, ... by one caller go through `wait_turn` in that order: step k
    waits until k - 1 has been let through (`passed`), at most `wait_s`; a number at or
    below one already let through (a retry) or 0 (unordered) goes at once. `joined`: the
    caller numbered steps before this object existed (a restarted executor, a new session):
    the first step heard of names where the order starts (`first`: the caller's first step
    since it last held no state here; 0: that step itself), so a later step that comes
    first still waits for the ones before it."""

    def __init__(self, wait_s: float = ORDER_WAIT_S, joined: bool = False):
        self.wait_s = wait_s
        self.joined = joined
        self.last = 0
        self._cond = threading.Condition()

    def wait_turn(self, step: int, first: int = 0) -> None:
        if step <= 0:
            return
        with self._cond:
            if self.joined:
                self.joined = False
                self.last = max(self.last, min(first or step, step) - 1)
            self._cond.wait_for(lambda: self.last >= step - 1, self.wait_s)

    def passed(self, step: int) -> None:
        with self._cond:
            if step > self.last:
                self.last = step
                self._cond.notify_all()
