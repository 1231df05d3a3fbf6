"""A step that survives a restart of the executor or of memsvc: one wrapper of each client's
step call (pagedserve.wire.clients), the retry read with the answer, on the thread that asks for it.

Contract: Execute UNAVAILABLE runs the same batch again (memsvc is not asked again);
Reserve UNAVAILABLE sends the same plan again; Execute ABORTED (another pool) raises
`PoolChanged`, and the step runner plans the step again; after `timeout_s` the error goes
up. A batch whose Execute never succeeded is run again, with its epoch, before the next
Reserve. Why each is safe: docs/ARCHITECTURE.md, "Retries and faults" and "The pool epoch".
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future

import grpc

from pagedserve.wire.clients import ExecutorClient, MemoryClient
from pagedserve.rpc.sent import Sent
from pagedserve.wire.protocol import ModelInfo, PoolStats
from pagedserve.wire.reserve_messages import Plan, ReserveResult
from pagedserve.wire.step_delta import StepDelta
from pagedserve.wire.step_outputs import StepOutputs

log = logging.getLogger("pagedserve.gateway")
RETRYABLE = (grpc.StatusCode.UNAVAILABLE,)


class PoolChanged(RuntimeError):
    """The KV pool the step was reserved in is gone: plan the step again."""


def _code(error: BaseException):
    return error.code() if isinstance(error, grpc.RpcError) and hasattr(error, "code") else None


def _call(send: Callable[[], Future]) -> Future:
    """`send()`, with an error raised while sending (an RPC made to encode the call: the
    executor's client asks memsvc for tables) as the answer, so that it is retried alike."""
    try:
        return send()
    except grpc.RpcError as e:
        failed: Future = Future()
        failed.set_exception(e)
        return failed


class StepRetry:
    """`memory` and `executor` are the retrying faces of the clients given; they share the
    policy and `dirty`, an Execute that never succeeded."""

    def __init__(self, memory: MemoryClient, executor: ExecutorClient, timeout_s: float = 60.0,
                 interval_s: float = 0.2, on_retry: Callable[[str, BaseException], None] | None = None):
        self.timeout_s = timeout_s
        self.interval_s = interval_s
        self.on_retry = on_retry
        self.dirty: StepDelta | None = None
        self.memory = RetriedMemory(memory, self)
        self.executor = RetriedExecutor(executor, self)

    def retried(self, call: str, first: Future, again: Callable[[], Future]):
        """The answer of `first`, a call already sent; while it is UNAVAILABLE, of `again()`,
        every `interval_s` up to `timeout_s`."""
        deadline, future = None, first
        while True:
            try:
                return future.result()
            except grpc.RpcError as e:
                if _code(e) not in RETRYABLE:
                    raise
                now = time.monotonic()
                if deadline is None:
                    deadline = now + self.timeout_s
                    log.warning("%s failed (%s: %s); retrying the step for up to %.0fs",
                                call, e.code().name, e.details(), self.timeout_s)
                if now >= deadline:
                    raise
                if self.on_retry is not None:
                    self.on_retry(call, e)
                time.sleep(self.interval_s)
            future = _call(again)


class RetriedMemory(MemoryClient):
    """Reserve retried, after the dirty batch ran; the rest passed through."""

    def __init__(self, inner: MemoryClient, retry: StepRetry):
        self.inner = inner
        self.retry = retry

    def reserve(self, plan: Plan) -> Future[ReserveResult]:
        self.retry.executor.run_dirty()
        first = _call(lambda: self.inner.reserve(plan))
        return Sent(lambda: self.retry.retried("reserve", first, lambda: self.inner.reserve(plan)))

    def free(self, seq_ids: list[str]) -> None:
        self.inner.free(seq_ids)

    def tables(self, seq_ids: list[str]) -> list[list[int]]:
        return self.inner.tables(seq_ids)

    def fork(self, parent_id: str, child_id: str) -> None:
        self.inner.fork(parent_id, child_id)

    def stats(self) -> PoolStats:
        return self.inner.stats()


class RetriedExecutor(ExecutorClient):
    """Execute retried; ABORTED raised as PoolChanged; a batch that stayed UNAVAILABLE is
    `dirty` until `run_dirty` runs it."""

    def __init__(self, inner: ExecutorClient, retry: StepRetry):
        self.inner = inner
        self.retry = retry

    def model_info(self) -> ModelInfo:
        return self.inner.model_info()

    def step(self, step: StepDelta) -> Future[StepOutputs]:
        first = _call(lambda: self.inner.step(step))
        return Sent(lambda: self._answer(step, first))

    def _answer(self, step: StepDelta, first: Future) -> StepOutputs:
        try:
            return self._retried(step, first)
        except PoolChanged:
            raise
        except grpc.RpcError as e:
            if _code(e) in RETRYABLE:
                self.retry.dirty = step
            raise

    def _retried(self, step: StepDelta, first: Future) -> StepOutputs:
        try:
            return self.retry.retried("execute", first, lambda: self.inner.step(step))
        except grpc.RpcError as e:
            if _code(e) == grpc.StatusCode.ABORTED:
                raise PoolChanged(e.details()) from None
            raise

    def run_dirty(self) -> None:
        """Run the batch whose Execute never succeeded (a changed pool: it is void)."""
        step = self.retry.dirty
        if step is not None:
            try:
                self._retried(step, _call(lambda: self.inner.step(step)))
            except PoolChanged:
                pass
            self.retry.dirty = None
