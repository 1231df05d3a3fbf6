"""A step that survives a restart of the executor or of memsvc.

Contract: Execute UNAVAILABLE runs the same batch again (memsvc is not asked again);
Reserve UNAVAILABLE sends the same plan again; Execute ABORTED (another pool) raises
`PoolChanged`, and the step runner plans the step again; after `timeout_s` the error goes
up. A batch whose Execute never succeeded is run again, with its epoch, before the next
Reserve. Why each is safe: docs/ARCHITECTURE.md, "Retries and faults" and "The pool epoch".
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import grpc

from wire.clients import ExecutorClient, MemoryClient
from wire.protocol import ModelInfo, Plan, PoolStats, ReserveResult, SampleOutput
from wire.step_delta import StepDelta

log = logging.getLogger("pagedserve.gateway")
RETRYABLE = (grpc.StatusCode.UNAVAILABLE,)


class PoolChanged(RuntimeError):
    """The KV pool the step was reserved in is gone: plan the step again."""


def _code(error: BaseException):
    return error.code() if isinstance(error, grpc.RpcError) and hasattr(error, "code") else None


class StepRetry:
    """`memory` and `executor` are the retrying faces of the clients given."""

    def __init__(self, memory: MemoryClient, executor: ExecutorClient, timeout_s: float = 60.0,
                 interval_s: float = 0.2, on_retry: Callable[[str, BaseException], None] | None = None):
        self.inner_memory = memory
        self.inner_executor = executor
        self.timeout_s = timeout_s
        self.interval_s = interval_s
        self.on_retry = on_retry
        self.dirty: StepDelta | None = None  # an Execute that never succeeded
        self.memory = _Memory(self)
        self.executor = _Executor(self)

    def reserve(self, plan: Plan) -> ReserveResult:
        self._run_dirty()
        return self._retry("reserve", lambda: self.inner_memory.reserve(plan))

    def reserve_later(self, plan: Plan) -> Callable[[], ReserveResult]:
        self._run_dirty()
        again = _first_then(self.inner_memory.reserve_later(plan), lambda: self.inner_memory.reserve(plan))
        return lambda: self._retry("reserve", again)

    def execute(self, batch: StepDelta) -> list[SampleOutput]:
        return self._execute(batch, lambda: self.inner_executor.execute(batch))

    def execute_later(self, batch: StepDelta) -> Callable[[], list[SampleOutput]]:
        again = _first_then(self.inner_executor.execute_later(batch),
                            lambda: self.inner_executor.execute(batch))
        return lambda: self._execute(batch, again)

    def _run_dirty(self) -> None:
        if self.dirty is not None:
            batch = self.dirty
            try:
                self._retry("execute", lambda: self._once(lambda: self.inner_executor.execute(batch)))
            except PoolChanged:
                pass
            self.dirty = None

    def _execute(self, batch: StepDelta, call: Callable[[], list[SampleOutput]]) -> list[SampleOutput]:
        try:
            return self._retry("execute", lambda: self._once(call))
        except PoolChanged:
            raise
        except grpc.RpcError as e:
            if _code(e) in RETRYABLE:
                self.dirty = batch
            raise

    @staticmethod
    def _once(call: Callable[[], list[SampleOutput]]) -> list[SampleOutput]:
        try:
            return call()
        except grpc.RpcError as e:
            if _code(e) == grpc.StatusCode.ABORTED:
                raise PoolChanged(e.details()) from None
            raise

    def _retry(self, call: str, fn):
        deadline = None
        while True:
            try:
                return fn()
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


def _first_then(first: Callable, again: Callable) -> Callable:
    """A call whose first try is `first` (a call already sent) and every later one `again`."""
    tries = [first]

    def call():
        return tries.pop()() if tries else again()
    return call


class _Memory(MemoryClient):
    """The MemoryClient face of StepRetry (reserve retried; the rest passed through)."""

    def __init__(self, retry: StepRetry):
        self._retry = retry
        self.calls_later = getattr(retry.inner_memory, "calls_later", False)

    def reserve(self, plan: Plan) -> ReserveResult:
        return self._retry.reserve(plan)

    def reserve_later(self, plan: Plan) -> Callable[[], ReserveResult]:
        return self._retry.reserve_later(plan)

    def free(self, seq_ids: list[str]) -> None:
        self._retry.inner_memory.free(seq_ids)

    def fork(self, parent_id: str, child_id: str) -> None:
        self._retry.inner_memory.fork(parent_id, child_id)

    def stats(self) -> PoolStats:
        return self._retry.inner_memory.stats()


class _Executor(ExecutorClient):
    """The ExecutorClient face of StepRetry (execute retried; model_info passed through)."""

    def __init__(self, retry: StepRetry):
        self._retry = retry
        self.feeds_itself = getattr(retry.inner_executor, "feeds_itself", False)
        self.calls_later = getattr(retry.inner_executor, "calls_later", False)

    def model_info(self) -> ModelInfo:
        return self._retry.inner_executor.model_info()

    def execute(self, batch: StepDelta) -> list[SampleOutput]:
        return self._retry.execute(batch)

    def execute_later(self, batch: StepDelta) -> Callable[[], list[SampleOutput]]:
        return self._retry.execute_later(batch)
