"""Drives a synchronous BatchLoop on one worker thread for any number of concurrent callers.

Every BatchLoop call (add_request, abort, step) happens on the worker thread. Callers post
commands into a queue; the worker applies them between steps, so an abort takes effect
before the next step and the sequence's blocks are freed by the next reserve. The worker
steps while there is work and sleeps on an event when idle.

With `max_waiting`, a request is refused with QueueFull when its sequences (n, or its beam
width) and those already waiting for their first (or next, after a preemption) step would
be more than that (`waiting_sequences`: held n > 1 samples and unforked beams count); one
that asks for more sequences than that alone, with RequestError. A step that raises
PoolChanged (memsvc restarted under it, see pagedserve.gateway.step_retry) is planned again without
failing anyone; any other failure ends the requests in flight.

`in_flight()` counts the requests submitted and not yet finished, aborted or failed;
`end_all(message)` ends every one of them before the next step, as a failed step does: each
sink gets BackendError(message) and the sequences are aborted (a draining gateway at its
deadline).
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from concurrent.futures import Future
from typing import Callable

import grpc

from pagedserve.gateway.batch_loop import BatchLoop
from pagedserve.gateway.request_intake import RequestError
from pagedserve.wire.protocol import Delta, SamplingParams
from pagedserve.gateway.step_retry import PoolChanged

log = logging.getLogger("pagedserve.gateway")

# What a request's sink receives: a list of deltas from one step, or an exception that ends it.
Sink = Callable[[list[Delta] | BaseException], None]


class BackendError(RuntimeError):
    """A step failed (memsvc or the executor did not answer); the requests in flight end."""


class QueueFull(RuntimeError):
    """Too many requests wait already; the message says how many and what to do."""


def describe(error: BaseException) -> str:
    """One line: a gRPC error's status and details, else the exception's text."""
    if isinstance(error, grpc.RpcError) and hasattr(error, "code"):
        return f"{error.code().name}: {error.details()}"
    return f"{type(error).__name__}: {error}"


class StepRunner:
    def __init__(self, loop: BatchLoop, on_step_error: Callable[[BaseException], None] | None = None,
                 on_step_ok: Callable[[], None] | None = None, max_waiting: int = 0):
        self.loop = loop
        self.max_waiting = max_waiting
        self.on_step_error = on_step_error
        self.on_step_ok = on_step_ok
        self._commands: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._stopping = False
        self._sinks: dict[str, Sink] = {}
        self._healthy = True
        self.num_steps = 0
        self.step_seconds = 0.0
        loop.deliver = self._dispatch  # overlap: stream step N's tokens while step N + 1 runs
        self._thread = threading.Thread(target=self._run, name="pagedserve-steps", daemon=True)
        self._thread.start()

    def submit(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
               sink: Sink, priority: int = 0, salt: str | None = None) -> Future:
        """Queue a request (`priority`: lower runs first; `salt`: its prefix-cache
        namespace). The future resolves once it is accepted, or raises RequestError."""
        done: Future = Future()
        self._post(("add", request_id, prompt_token_ids, sampling, sink, priority, done, salt))
        return done

    def abort(self, request_id: str) -> None:
        """Stop a request; its sink gets nothing more. Safe to call for finished requests."""
        self._post(("abort", request_id))

    def in_flight(self) -> int:
        """Requests submitted and not yet finished, aborted or failed."""
        return len(self._sinks) + sum(1 for command in list(self._commands) if command[0] == "add")

    def end_all(self, message: str) -> None:
        """End every request in flight (and every one queued) with BackendError(message),
        before the next step."""
        self._post(("end_all", message))

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)
        if not self._thread.is_alive():  # else a step is still waiting on the executor
            self.loop.close()

    def _post(self, command: tuple) -> None:
        self._commands.append(command)
        self._wake.set()

    def _run(self) -> None:
        while not self._stopping:
            self._apply_commands()
            if not self.loop.has_work():
                self._wake.wait()
                self._wake.clear()
                continue
            start = time.perf_counter()
            try:
                deltas = self.loop.step()
            except PoolChanged as e:  # memsvc restarted: its answer is void, plan again
                log.warning("the KV pool changed under a step (%s); planning it again", e)
                self._end_orphans()
                continue
            except Exception as e:  # memsvc or the executor failed: end what is in flight
                self._fail_all(e)
                time.sleep(0.5)
                continue
            self.num_steps += 1
            self.step_seconds += time.perf_counter() - start
            if not self._healthy and self.on_step_ok:
                self.on_step_ok()
            self._healthy = True
            self._dispatch(deltas)

    def _apply_commands(self) -> None:
        while self._commands:
            command = self._commands.popleft()
            if command[0] == "abort":
                self._sinks.pop(command[1], None)
                self.loop.abort(command[1])
                continue
            if command[0] == "end_all":
                self._end_all(BackendError(command[1]))
                continue
            _, request_id, prompt, sampling, sink, priority, done, salt = command
            if not done.set_running_or_notify_cancel():
                continue  # the caller went away (cancelled, deadline) before its turn
            refusal = self._over_max_waiting(sampling)
            if refusal is not None:
                done.set_exception(refusal)
                continue
            try:
                self.loop.add_request(request_id, prompt, sampling, priority=priority, salt=salt)
            except Exception as e:
                done.set_exception(e)
                continue
            self._sinks[request_id] = sink
            done.set_result(None)

    def _over_max_waiting(self, sampling: SamplingParams) -> Exception | None:
        """Why a request of `sampling` may not queue now (--max-waiting counts sequences: each
        of its n, or its beams); None if it may."""
        if not self.max_waiting:
            return None
        wanted = sampling.beam_width if sampling.beam_search else sampling.n
        if wanted > self.max_waiting:
            what = f"beam_width={wanted}" if sampling.beam_search else f"n={wanted}"
            return RequestError(f"{what} asks for {wanted} sequences, more than this gateway lets wait "
                                f"(--max-waiting {self.max_waiting}): ask for fewer")
        waiting = waiting_sequences(self.loop.scheduler)
        if waiting + wanted > self.max_waiting:
            return QueueFull(f"the request queue is full ({waiting} sequences waiting; this request's "
                             f"{wanted} would pass the limit of {self.max_waiting}, --max-waiting): "
                             "retry later or on another replica")
        return None

    def _dispatch(self, deltas: list[Delta]) -> None:
        by_request: dict[str, list[Delta]] = {}
        for d in deltas:
            by_request.setdefault(d.request_id, []).append(d)
        for request_id, batch in by_request.items():
            sink = self._sinks.get(request_id)
            if request_id not in self.loop.requests:
                self._sinks.pop(request_id, None)
            if sink is not None:
                sink(batch)

    def _end_orphans(self) -> None:
        """Requests the interrupted step ended (a rejection) whose delta never came out."""
        for request_id in [r for r in self._sinks if r not in self.loop.requests]:
            self._sinks.pop(request_id)(BackendError(
                "the step was interrupted by a memsvc restart: retry the request"))

    def _fail_all(self, error: Exception) -> None:
        reason = describe(error)
        log.error("step failed, ending %d requests: %s", len(self._sinks), reason)
        self._healthy = False
        if self.on_step_error:
            self.on_step_error(error)
        self._end_all(BackendError(f"the model backend failed, retry later: {reason}"))

    def _end_all(self, error: BackendError) -> None:
        for request_id in list(self.loop.requests):
            self.loop.abort(request_id)
        sinks, self._sinks = self._sinks, {}
        for sink in sinks.values():
            sink(error)


def waiting_sequences(scheduler) -> int:
    """Sequences that wait for their first step: the waiting queue, the samples held for their
    fork (n > 1), and the beams that a beam search not started yet will fork."""
    count = len(scheduler.waiting) + sum(len(samples) for samples in scheduler.held.values())
    searches = scheduler.beams
    if searches:
        for seq in scheduler.waiting:
            search = searches.get(seq.request_id)
            if search is not None and search.num_forks == 1:
                count += search.width - 1
    return count
