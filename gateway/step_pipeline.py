"""The steps the overlapped loop has at the executor: at most two, the running one first.

`send` numbers a batch (`StepDelta.step`: the executor runs them in that order) and puts it
on its way while step N runs: an executor client that `calls_later` (the remote one)
writes it on the loop's own thread and its answer is read when `wait` asks for it, with
no helper thread and no handoff between threads; any other (in process) runs it on one of
two helper threads. `wait` gives a step's outputs and the executor seconds it took,
counted from when the step before it ended (not while it queued behind it) to when its
answer was read. A step sent ahead (`fed`: it computes tokens the running step samples,
wire.step_feed) that fails is sent again by `resend` with those tokens, known by then.
An in-process executor is run through wire.ordered_executor; one across the wire feeds
and orders itself. See docs/ARCHITECTURE.md, "The step path".
"""
from __future__ import annotations

import collections
import itertools
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from wire.pending_token import PENDING
from wire.protocol import SampleOutput
from wire.step_delta import StepDelta


class Later:
    """A call already sent whose answer is read on the thread that asks for it: `result`
    (the call's error raised), as a Future's, but never done before it is asked."""

    def __init__(self, answer: Callable[[], object]):
        self._answer = answer
        self._done = False
        self._value = self._error = None

    def result(self):
        if not self._done:
            try:
                self._value = self._answer()
            except BaseException as e:  # noqa: BLE001 - kept for whoever asks, as a Future keeps it
                self._error = e
            self._done = True
        if self._error is not None:
            raise self._error
        return self._value

    def done(self) -> bool:
        return self._done

    def exception(self) -> BaseException | None:
        try:
            self.result()
        except BaseException as e:  # noqa: BLE001
            return e
        return None


def settle(calls) -> None:
    """Wait until every call (a Future or a Later) has ended, its outcome dropped."""
    for call in calls:
        call.exception()


@dataclass
class InFlight:
    batch: StepDelta
    future: Future | Later
    fed: bool  # sent ahead: computes the previous step's samples
    sent: float = 0.0  # perf_counter

    def failed(self) -> bool:
        """Ended with an error already (a step sent ahead of it would fail too)."""
        return self.future.done() and self.future.exception() is not None


def _timed(fn, batch):
    result = fn(batch)
    return result, time.perf_counter()


def submit_on_wire(pool: ThreadPoolExecutor, fn, *args) -> Future:
    """`pool.submit(fn, *args)`, returning once the helper has started it. The helper then
    has the GIL until its call blocks on the wire; else it waits for this thread's work, up
    to the 5 ms switch interval."""
    started = threading.Event()

    def call():
        started.set()
        return fn(*args)

    future = pool.submit(call)
    started.wait(1.0)
    return future


class StepPipeline:
    def __init__(self, executor):
        self.executor = executor
        self.calls_later = getattr(executor, "calls_later", False)
        self.inflight: collections.deque[InFlight] = collections.deque()
        self._numbers = itertools.count(1)
        self._pool: ThreadPoolExecutor | None = None
        self._last_end = 0.0  # perf_counter when the last step waited for ended

    def _helpers(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(2, thread_name_prefix="pagedserve-execute")
        return self._pool

    def send(self, batch: StepDelta, fed: bool) -> InFlight:
        batch.step = next(self._numbers)
        sent = time.perf_counter()
        if self.calls_later:
            answer = self.executor.execute_later(batch)
            call = Later(lambda: (answer(), time.perf_counter()))
        else:
            call = submit_on_wire(self._helpers(), _timed, self.executor.execute, batch)
        step = InFlight(batch, call, fed, sent)
        self.inflight.append(step)
        return step

    def wait(self, step: InFlight) -> tuple[list[SampleOutput], float]:
        """The outputs of the oldest step in flight (removed), and its executor seconds."""
        assert self.inflight and self.inflight[0] is step
        try:
            outputs, end = step.future.result()
        finally:
            self.inflight.popleft()
        seconds, self._last_end = end - max(self._last_end, step.sent), end
        return outputs, seconds

    def resend(self, step: InFlight) -> list[SampleOutput]:
        """Run a failed step sent ahead again, on this thread, now that its tokens are in
        (`patch`); after every other step in flight ended."""
        settle(s.future for s in self.inflight)
        self.patch(step)
        step.batch.step = next(self._numbers)
        outputs = self.executor.execute(step.batch)
        self._last_end = time.perf_counter()
        return outputs

    def drain(self) -> list[InFlight]:
        """Wait for every step in flight to end (their outputs dropped); returns them."""
        steps = list(self.inflight)
        settle(s.future for s in steps)
        self.inflight.clear()
        return steps

    @staticmethod
    def patch(step: InFlight) -> None:
        """Put the tokens the step before sampled in place of PENDING (a sequence
        gone meanwhile gets any token: its output is dropped)."""
        batch = step.batch
        tokens, at = batch.token_ids, 0
        for seq, p, n in zip(batch.seqs, batch.start_pos, batch.num_tokens):
            if tokens[at] == PENDING:
                plen, out = len(seq.prompt_token_ids), seq.output_token_ids
                tokens[at] = out[p - plen] if 0 <= p - plen < len(out) else 0
            at += n

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
