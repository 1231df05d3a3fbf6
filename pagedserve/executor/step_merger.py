"""Merge Execute calls that arrive together into one forward pass, and launch the next pass
while the last one still runs on the device.

Several gateways may drive one executor. Each Execute call hands its StepBatch to
`StepMerger.run`; passes are launched from one model thread, and batches that arrive while
one runs queue up, and the next pass takes all of them at once: their sequences are
concatenated into one StepBatch, and the outputs (pagedserve.wire.step_outputs: one per
sequence that `reports`, in batch order) are split back to the callers by position (slices
of the columns), so equal sequence ids from different gateways never mix. A pass that
raises fails every call merged into it.

A launch (`Launched`) hands back the pass's outputs and when the device will have finished
it. An executor that computes on the CPU finishes inside the launch; one whose device runs
behind the host finishes later: a GPU's outputs come pending (pagedserve.wire.pending_outputs,
done when they reach the host), the simulated executor's (pagedserve.executor.simulated) at
`ends_at` (a waiter thread wakes the model thread when pending outputs are done, so that
nothing polls). While a pass runs the model thread launches the next pass that has come, so the
device starts it the moment the last one ends (two passes in flight at most); a caller's
answer is sent once its pass has ended.

Gateways step in turn (each waits for its answer, then plans its next step), so without
help each pass would hold one gateway's batch while the other's waits. Before a pass the
merger therefore waits a little (at most `window` of the last pass's time, capped by
`max_wait_s`, or until just before the running pass ends) for the callers that were active in the last
second and have not sent their batch yet. With one caller it never waits.
"""
from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

from pagedserve.step.batch_parts import concat
from pagedserve.step.step_batch import StepBatch
from pagedserve.wire.pending_outputs import PendingOutputs
from pagedserve.wire.step_outputs import StepOutputs

ACTIVE_S = 1.0  # a caller heard from within this long is expected at the next pass
LAUNCH_MARGIN_S = 1e-3  # behind a running pass, stop gathering this long before it ends


@dataclass
class Launched:
    """A launched pass: its outputs, the device seconds it takes, and when (time.monotonic)
    the device will have finished it (0: finished already, or when pending outputs are done)."""
    outputs: StepOutputs | PendingOutputs
    seconds: float = 0.0
    ends_at: float = 0.0
    started: float = 0.0  # time.perf_counter() at the launch, set by the merger


def launch_of(execute: Callable[[StepBatch], StepOutputs]) -> Callable[[StepBatch], Launched]:
    """A launch for an executor that computes inside `execute`: finished when it returns."""
    def launch(batch: StepBatch) -> Launched:
        start = time.perf_counter()
        outputs = execute(batch)
        return Launched(outputs, time.perf_counter() - start)

    return launch


class _Work:
    __slots__ = ("batch", "done", "caller", "before", "after")

    def __init__(self, batch, done, caller, before, after):
        self.batch, self.done, self.caller, self.before, self.after = batch, done, caller, before, after


class StepMerger:
    """`launch` runs on one long-lived thread of the merger's (the model thread), which
    also runs each call's `before()` just before its pass is launched (a raise fails that
    call alone) and `after(outputs)` just after. `run` returns (outputs, device seconds)."""

    def __init__(self, launch: Callable[[StepBatch], Launched],
                 on_merged: Callable[[int], None] | None = None, window: float = 0.25,
                 max_wait_s: float = 0.02, hold_s: float = 0.0):
        self.launch = launch
        # pending outputs with no end of their own count as running at least this long (a CPU's
        # held readback: the next step, when it comes within it, reads its fed tokens from them)
        self.hold_s = hold_s
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
        self._waiting: queue.SimpleQueue = queue.SimpleQueue()  # pending outputs, for the waiter thread
        self._waiter: threading.Thread | None = None

    def run(self, batch: StepBatch, caller: str = "", before: Callable[[], None] | None = None,
            after: Callable[[StepOutputs], None] | None = None) -> tuple[StepOutputs, float]:
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
        running = None  # (works, Launched) of the pass on the device
        while True:
            with self._cond:
                if running is None:
                    self._cond.wait_for(lambda: self._queue)
                    self._forget_idle()
                    self._cond.wait_for(self._all_in, min(self.window * self._last_pass_s, self.max_wait_s))
                else:
                    self._behind(running[1])
                work, self._queue = self._queue, []
            launched = self._launch(work) if work else None
            if running is not None:
                self._finish(*running)
            running = launched
            if running is not None and _ended(running[1]):
                self._finish(*running)
                running = None

    def _behind(self, launched: Launched) -> None:
        """While `launched` runs (lock held): return once the active callers have all queued a
        batch, or some has and the pass is about to end (LAUNCH_MARGIN_S), or it has ended."""
        self._forget_idle()
        while not _ended(launched):
            left = launched.ends_at - time.monotonic()
            if self._queue and (self._all_in() or left <= LAUNCH_MARGIN_S):
                return
            self._cond.wait(left - LAUNCH_MARGIN_S if self._queue else left)  # or the waiter's word

    def _wait_on_device(self) -> None:
        """The waiter thread: wakes the model thread when pending outputs are done."""
        while True:
            self._waiting.get().wait()
            with self._cond:
                self._cond.notify_all()

    def _forget_idle(self) -> None:
        now = time.monotonic()
        for caller in [c for c, t in self._last_seen.items() if now - t > ACTIVE_S]:
            del self._last_seen[caller]

    def _all_in(self) -> bool:
        """Every caller active in the last ACTIVE_S has queued a batch (lock held)."""
        return bool(self._queue) and {w.caller for w in self._queue} >= set(self._last_seen)

    def _launch(self, work: list[_Work]) -> tuple[list[_Work], Launched] | None:
        ready = []
        for w in work:
            try:
                if w.before is not None:
                    w.before()
                ready.append(w)
            except BaseException as e:
                w.done.set_exception(e)
        if not ready:
            return None
        merged = concat([w.batch for w in ready])
        started = time.perf_counter()
        try:
            launched = self.launch(merged)
        except BaseException as e:  # every caller of this pass gets the error
            for w in ready:
                w.done.set_exception(e)
            return None
        launched.started = started
        if isinstance(launched.outputs, PendingOutputs):  # ends about as long after as the last pass took
            launched.ends_at = launched.ends_at or time.monotonic() + max(self._last_pass_s, self.hold_s)
            if self._waiter is None:
                self._waiter = threading.Thread(target=self._wait_on_device, name="pagedserve-readback",
                                                daemon=True)
                self._waiter.start()
            self._waiting.put(launched.outputs)
        else:
            self._last_pass_s = launched.seconds
        self.num_passes += 1
        if len(ready) > 1:
            self.num_merged += len(ready)
            if self.on_merged is not None:
                self.on_merged(len(ready))
        outputs = launched.outputs
        if not isinstance(outputs, PendingOutputs):
            outputs = StepOutputs.of(outputs)
        at, row, finished = 0, 0, []
        for w in ready:
            if merged is not w.batch:  # the sequences the pass left out, back to their own batch
                b = w.batch
                b.errors.update({i - row: e for i, e in merged.errors.items() if row <= i < row + b.num_seqs})
                row += b.num_seqs
            n = int(w.batch.reports().sum())
            mine = outputs if len(ready) == 1 and n == len(outputs) else outputs.part(at, at + n)
            at += n
            try:
                if w.after is not None:
                    w.after(mine)
            except BaseException as e:
                w.done.set_exception(e)
                continue
            finished.append((w, mine))
        return finished, launched

    def _finish(self, finished: list, launched: Launched) -> None:
        """Answer the pass's callers once the device has ended it."""
        left = launched.ends_at - time.monotonic()
        if isinstance(launched.outputs, PendingOutputs):
            try:
                launched.outputs.result()  # waits for the device
            except BaseException as e:
                for w, _ in finished:
                    w.done.set_exception(e)
                return
            launched.seconds = self._last_pass_s = max(launched.seconds, time.perf_counter() - launched.started)
        elif left > 0:
            time.sleep(left)
        for w, mine in finished:
            w.done.set_result((mine.result() if isinstance(mine, PendingOutputs) else mine, launched.seconds))


def _ended(launched: Launched) -> bool:
    if isinstance(launched.outputs, PendingOutputs):
        return launched.outputs.done() or launched.ends_at <= time.monotonic()
    return launched.ends_at <= time.monotonic()
