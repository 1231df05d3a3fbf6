"""The steps the overlapped loop has at the executor: at most two, the running one first.

`send` numbers a batch (`StepDelta.step`: the executor runs them in that order) and hands
it to one of two helper threads, so step N + 1 is on its way while step N runs; the helper
only waits on the executor. `wait` gives a step's outputs and the executor seconds it
took, counted from when the step before it ended (not while it queued behind it). A step
sent ahead (`fed`: it computes tokens the running step samples, wire.step_feed) that
fails is sent again by `resend` with those tokens, known by then. An in-process executor is
run through wire.ordered_executor; one across the wire feeds and orders itself.
See docs/ARCHITECTURE.md, "The step path".
"""
from __future__ import annotations

import collections
import itertools
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from wire.protocol import SampleOutput
from wire.step_delta import StepDelta
from wire.step_feed import FED


@dataclass
class InFlight:
    batch: StepDelta
    future: Future
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
        self.inflight: collections.deque[InFlight] = collections.deque()
        self._numbers = itertools.count(1)
        self._pool: ThreadPoolExecutor | None = None
        self._last_end = 0.0  # perf_counter when the last step waited for ended

    def send(self, batch: StepDelta, fed: bool) -> InFlight:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(2, thread_name_prefix="pagedserve-execute")
        batch.step = next(self._numbers)
        sent = time.perf_counter()
        step = InFlight(batch, submit_on_wire(self._pool, _timed, self.executor.execute, batch), fed, sent)
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
        wait([s.future for s in self.inflight])
        self.patch(step)
        step.batch.step = next(self._numbers)
        outputs = self.executor.execute(step.batch)
        self._last_end = time.perf_counter()
        return outputs

    def drain(self) -> list[InFlight]:
        """Wait for every step in flight to end (their outputs dropped); returns them."""
        steps = list(self.inflight)
        wait([s.future for s in steps])
        self.inflight.clear()
        return steps

    @staticmethod
    def patch(step: InFlight) -> None:
        """Put the tokens the step before sampled in place of FED (a sequence
        gone meanwhile gets any token: its output is dropped)."""
        for s in step.batch.seqs:
            seq = s.seq
            if not s.token_ids or s.token_ids[0] != FED or seq is None:
                continue
            p, plen = s.start_pos, len(seq.prompt_token_ids)
            out = seq.output_token_ids
            s.token_ids = [out[p - plen] if 0 <= p - plen < len(out) else 0]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
