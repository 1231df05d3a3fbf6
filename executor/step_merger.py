"""Merge Execute calls that arrive together into one forward pass.

Several gateways may drive one executor. Each Execute call hands its StepBatch to
`StepMerger.run`; while a forward pass is running, batches that arrive queue up, and the
next pass takes all of them at once: their sequences are concatenated into one StepBatch,
and the outputs (one per sequence with sample=True, in batch order) are split back to the
callers by position, so equal sequence ids from different gateways never mix. Only one
pass runs at a time. A pass that raises fails every call merged into it.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Callable

from pagedserve.protocol import SampleOutput, StepBatch


class StepMerger:
    def __init__(self, execute: Callable[[StepBatch], list[SampleOutput]]):
        self.execute = execute
        self._lock = threading.Lock()
        self._queue: list[tuple[StepBatch, Future]] = []
        self._running = False
        self.num_passes = 0
        self.num_merged = 0  # calls that shared a pass with another

    def run(self, batch: StepBatch) -> list[SampleOutput]:
        done: Future = Future()
        with self._lock:
            self._queue.append((batch, done))
            lead = not self._running
            self._running = self._running or lead
        if lead:
            self._drain()
        return done.result()

    def _drain(self) -> None:
        """Run passes until the queue is empty (on the thread of the call that found none running)."""
        while True:
            with self._lock:
                work, self._queue = self._queue, []
                if not work:
                    self._running = False
                    return
            self._pass(work)

    def _pass(self, work: list[tuple[StepBatch, Future]]) -> None:
        merged = StepBatch([s for batch, _ in work for s in batch.seqs])
        try:
            outputs = self.execute(merged)
        except BaseException as e:  # every caller of this pass gets the error
            for _, done in work:
                done.set_exception(e)
            return
        self.num_passes += 1
        if len(work) > 1:
            self.num_merged += len(work)
        at = 0
        for batch, done in work:
            n = sum(1 for s in batch.seqs if s.sample)
            done.set_result(outputs[at:at + n])
            at += n
