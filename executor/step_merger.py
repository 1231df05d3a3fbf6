"""Merge Execute calls that arrive together into one forward pass.

Several gateways may drive one executor. Each Execute call hands its StepBatch to
`StepMerger.run`; while a forward pass is running, batches that arrive queue up, and the
next pass takes all of them at once: their sequences are concatenated into one StepBatch,
and the outputs (one per sequence that `reports`, in batch order) are split back to the
callers by position, so equal sequence ids from different gateways never mix. Only one
pass runs at a time. A pass that raises fails every call merged into it.

Gateways step in turn (each waits for its answer, then plans its next step), so without
help each pass would hold one gateway's batch while the other's waits. Before a pass the
merger therefore waits a little (at most `window` of the last pass's time, capped by
`max_wait_s`) for the callers that were active in the last second and have not sent their
batch yet. With one caller it never waits.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Callable

from wire.protocol import SampleOutput, StepBatch

ACTIVE_S = 1.0  # a caller heard from within this long is expected at the next pass


class StepMerger:
    def __init__(self, execute: Callable[[StepBatch], list[SampleOutput]],
                 on_merged: Callable[[int], None] | None = None, window: float = 0.25,
                 max_wait_s: float = 0.02):
        self.execute = execute
        self.on_merged = on_merged  # called with the number of calls a merged pass served
        self.window = window
        self.max_wait_s = max_wait_s
        self._cond = threading.Condition()
        self._queue: list[tuple[StepBatch, Future, str]] = []
        self._running = False
        self._last_seen: dict[str, float] = {}
        self._last_pass_s = 0.0
        self.num_passes = 0
        self.num_merged = 0  # calls that shared a pass with another

    def run(self, batch: StepBatch, caller: str = "") -> list[SampleOutput]:
        done: Future = Future()
        with self._cond:
            self._queue.append((batch, done, caller))
            self._last_seen[caller] = time.monotonic()
            self._cond.notify_all()
            lead = not self._running
            self._running = True
        if lead:
            self._drain()
        return done.result()

    def _drain(self) -> None:
        """Run passes until the queue is empty (on the thread of the call that found none running)."""
        while True:
            with self._cond:
                self._gather()
                work, self._queue = self._queue, []
                if not work:
                    self._running = False
                    return
            self._pass(work)

    def _gather(self) -> None:
        """Wait briefly for the active callers that have not queued a batch yet (lock held)."""
        if not self._queue:
            return
        now = time.monotonic()
        for caller in [c for c, t in self._last_seen.items() if now - t > ACTIVE_S]:
            del self._last_seen[caller]

        def all_in() -> bool:
            return {c for _, _, c in self._queue} >= set(self._last_seen)

        self._cond.wait_for(all_in, min(self.window * self._last_pass_s, self.max_wait_s))

    def _pass(self, work: list[tuple[StepBatch, Future, str]]) -> None:
        merged = StepBatch([s for batch, _, _ in work for s in batch.seqs],
                           forget=[f for batch, _, _ in work for f in batch.forget])
        start = time.monotonic()
        try:
            outputs = self.execute(merged)
        except BaseException as e:  # every caller of this pass gets the error
            for _, done, _ in work:
                done.set_exception(e)
            return
        finally:
            self._last_pass_s = time.monotonic() - start
        self.num_passes += 1
        if len(work) > 1:
            self.num_merged += len(work)
            if self.on_merged is not None:
                self.on_merged(len(work))
        at = 0
        for batch, done, _ in work:
            n = sum(1 for s in batch.seqs if s.reports)
            done.set_result(outputs[at:at + n])
            at += n
