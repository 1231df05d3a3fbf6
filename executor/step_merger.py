"""Merge Execute calls that arrive together into one forward pass.

Several gateways may drive one executor. Each Execute call hands its StepBatch to
`StepMerger.run`; passes run on one model thread, and while one is running, batches that
arrive queue up, and the next pass takes all of them at once: their sequences are concatenated into one StepBatch,
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


class _Work:
    __slots__ = ("batch", "done", "caller", "before", "after")

    def __init__(self, batch, done, caller, before, after):
        self.batch, self.done, self.caller, self.before, self.after = batch, done, caller, before, after


class StepMerger:
    """`execute` runs on one long-lived thread of the merger's (the model thread), which
    also runs each call's `before()` just before its pass (a raise fails that call alone)
    and `after(outputs)` just after it."""

    def __init__(self, execute: Callable[[StepBatch], list[SampleOutput]],
                 on_merged: Callable[[int], None] | None = None, window: float = 0.25,
                 max_wait_s: float = 0.02):
        self.execute = execute
        self.on_merged = on_merged  # called with the number of calls a merged pass served
        self.window = window
        self.max_wait_s = max_wait_s
        self._cond = threading.Condition()
        self._queue: list[_Work] = []
        self._last_seen: dict[str, float] = {}
        self._last_pass_s = 0.0
        self.num_passes = 0
        self.num_merged = 0  # calls that shared a pass with another
        self._thread: threading.Thread | None = None

    def run(self, batch: StepBatch, caller: str = "", before: Callable[[], None] | None = None,
            after: Callable[[list[SampleOutput]], None] | None = None) -> list[SampleOutput]:
        done: Future = Future()
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="pagedserve-model", daemon=True)
                self._thread.start()
            self._queue.append(_Work(batch, done, caller, before, after))
            self._last_seen[caller] = time.monotonic()
            self._cond.notify_all()
        return done.result()

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue)
                self._gather()
                work, self._queue = self._queue, []
            self._pass(work)

    def _gather(self) -> None:
        """Wait briefly for the active callers that have not queued a batch yet (lock held)."""
        now = time.monotonic()
        for caller in [c for c, t in self._last_seen.items() if now - t > ACTIVE_S]:
            del self._last_seen[caller]

        def all_in() -> bool:
            return {w.caller for w in self._queue} >= set(self._last_seen)

        self._cond.wait_for(all_in, min(self.window * self._last_pass_s, self.max_wait_s))

    def _pass(self, work: list[_Work]) -> None:
        ready = []
        for w in work:
            try:
                if w.before is not None:
                    w.before()
                ready.append(w)
            except BaseException as e:
                w.done.set_exception(e)
        if not ready:
            return
        merged = StepBatch([s for w in ready for s in w.batch.seqs],
                           forget=[f for w in ready for f in w.batch.forget])
        start = time.monotonic()
        try:
            outputs = self.execute(merged)
        except BaseException as e:  # every caller of this pass gets the error
            for w in ready:
                w.done.set_exception(e)
            return
        finally:
            self._last_pass_s = time.monotonic() - start
        self.num_passes += 1
        if len(ready) > 1:
            self.num_merged += len(ready)
            if self.on_merged is not None:
                self.on_merged(len(ready))
        at = 0
        for w in ready:
            n = sum(1 for s in w.batch.seqs if s.reports)
            mine = outputs[at:at + n]
            at += n
            try:
                if w.after is not None:
                    w.after(mine)
            except BaseException as e:
                w.done.set_exception(e)
                continue
            w.done.set_result(mine)
