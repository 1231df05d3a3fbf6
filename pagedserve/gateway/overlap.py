"""What the batching loop carries from one step to the next: the steps it has at the executor
(at most two, the running one first; the serial loop's is gone by the time its call ends),
the last step's tokens not yet turned into deltas, the deltas a failed step made, and the
plan-ahead counters. pagedserve.gateway.batch_loop's phases read and change it; nothing else does.

`send` numbers a step (`StepDelta.step`: the executor runs them in that order) and puts it
on its way through the ExecutorClient (pagedserve.wire.clients); `wait` gives its outputs and the
executor seconds it took, counted from when the step before it ended (not while it queued
behind it) to when its answer came. A step sent ahead (`fed`: it computes tokens the running
step samples, pagedserve.wire.step_feed) that fails for want of them is sent again by `resend` with
those tokens, known by then. See docs/ARCHITECTURE.md, "The step path".
"""
from __future__ import annotations

import collections
import itertools
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from pagedserve.gateway.step_updates import StepUpdates
from pagedserve.wire.clients import ExecutorClient
from pagedserve.wire.pending_token import PENDING
from pagedserve.wire.protocol import Delta
from pagedserve.wire.step_delta import StepDelta
from pagedserve.wire.step_feed import lost_feed
from pagedserve.wire.step_outputs import StepOutputs


@dataclass
class InFlight:
    batch: StepDelta
    future: Future  # of StepOutputs
    fed: bool  # sent ahead: computes the previous step's samples
    sent: float = 0.0  # perf_counter
    ended: float = 0.0  # perf_counter when its answer came

    def failed(self) -> bool:
        """Ended with an error already (a step sent ahead of it would fail too)."""
        return self.future.done() and self.future.exception() is not None


@dataclass
class Overlap:
    inflight: collections.deque = field(default_factory=collections.deque)  # of InFlight
    unapplied: StepUpdates = field(default_factory=StepUpdates)  # the last step's
    ready: list[Delta] = field(default_factory=list)  # made by a step that then failed
    num_ahead: int = 0  # plans reserved ahead, and of them deferred by memsvc
    num_deferred: int = 0
    num_resent: int = 0  # steps sent ahead that failed and ran again
    last_end: float = 0.0  # perf_counter when the last step waited for ended
    numbers: itertools.count = field(default_factory=lambda: itertools.count(1))

    def send(self, executor: ExecutorClient, batch: StepDelta, fed: bool) -> InFlight:
        batch.step = next(self.numbers)
        sent = time.perf_counter()
        step = InFlight(batch, executor.step(batch), fed, sent)
        step.future.add_done_callback(lambda _: setattr(step, "ended", time.perf_counter()))
        self.inflight.append(step)
        return step

    def outputs(self, executor: ExecutorClient, step: InFlight) -> tuple[StepOutputs, float]:
        """The outputs of the oldest step in flight (removed), and its executor seconds; a
        step sent ahead that failed for want of its fed tokens (the executor restarted, or
        the step before failed) runs again with them."""
        try:
            return self.wait(step)
        except Exception as e:
            if not (step.fed and lost_feed(e)):
                raise
        t0 = time.perf_counter()
        outputs = self.resend(executor, step)
        return outputs, time.perf_counter() - t0

    def wait(self, step: InFlight) -> tuple[StepOutputs, float]:
        """The outputs of the oldest step in flight (removed), and its executor seconds."""
        assert self.inflight and self.inflight[0] is step
        try:
            outputs = step.future.result()
        finally:
            self.inflight.popleft()
        end = step.ended or time.perf_counter()
        seconds, self.last_end = end - max(self.last_end, step.sent), end
        return outputs, seconds

    def resend(self, executor: ExecutorClient, step: InFlight) -> StepOutputs:
        """Run a failed step sent ahead again, now that its tokens are in (`patch`); after
        every other step in flight ended."""
        settle(s.future for s in self.inflight)
        patch(step.batch)
        step.batch.step = next(self.numbers)
        self.num_resent += 1
        outputs = executor.step(step.batch).result()
        self.last_end = time.perf_counter()
        return outputs

    def drain(self) -> list[InFlight]:
        """Wait for every step in flight to end (their outputs dropped); returns them."""
        steps = list(self.inflight)
        settle(s.future for s in steps)
        self.inflight.clear()
        return steps

    def take_unapplied(self) -> StepUpdates:
        updates, self.unapplied = self.unapplied, StepUpdates()
        return updates


def settle(futures) -> None:
    """Wait until every call has ended, its outcome dropped."""
    for future in futures:
        future.exception()


def patch(batch: StepDelta) -> None:
    """Put the tokens the step before sampled in place of PENDING (a sequence gone meanwhile
    gets any token: its output is dropped)."""
    tokens, at = batch.token_ids, 0
    for seq, p, n in zip(batch.seqs, batch.start_pos, batch.num_tokens):
        if tokens[at] == PENDING:
            plen, out = len(seq.prompt_token_ids), seq.output_token_ids
            tokens[at] = out[p - plen] if 0 <= p - plen < len(out) else 0
        at += n
