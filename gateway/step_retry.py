"""A step that survives a restart of the executor or of memsvc.

What a failed step leaves behind: a Reserve that succeeded has already appended the step's
tokens to memsvc's block tables and keyed the blocks they fill for the prefix cache, but
the slots hold nothing until an Execute writes them. So:

- Execute failed with UNAVAILABLE (the executor died or is starting): run the same batch
  again until it answers. The step is re-runnable: the same slots are rewritten and
  sampling derives from (seed, position). Memsvc is not asked again.
- The executor answers ABORTED because the pool is not the one the batch was reserved in
  (memsvc restarted, the executor re-registered): the reservation is void. `PoolChanged`
  tells the step runner to plan the step again; memsvc no longer holds the running
  sequences, answers them "preempted, recompute", and they are recomputed.
- Reserve failed with UNAVAILABLE (memsvc down, or up without a pool yet): send the same
  plan again. Memsvc did not apply it, or lost everything when it died.
- Still failing after `timeout_s`: the error goes up (the requests end). A batch whose
  Execute never succeeded is kept and run again before the next Reserve, so blocks memsvc
  keyed for the prefix cache never stay unwritten.

The pool is named by the epoch memsvc sends with every Reserve (`pool_id` of the remote
memory client) and checked by the executor; in-process backends have none and skip this.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import grpc

from wire.protocol import Plan, ReserveResult, SampleOutput, StepBatch

log = logging.getLogger("pagedserve.gateway")
RETRYABLE = (grpc.StatusCode.UNAVAILABLE,)


class PoolChanged(RuntimeError):
    """The KV pool the step was reserved in is gone: plan the step again."""


def _code(error: BaseException):
    return error.code() if isinstance(error, grpc.RpcError) and hasattr(error, "code") else None


class StepRetry:
    def __init__(self, memory, executor, timeout_s: float = 60.0, interval_s: float = 0.2,
                 on_retry: Callable[[str, BaseException], None] | None = None):
        self.inner_memory = memory
        self.inner_executor = executor
        self.timeout_s = timeout_s
        self.interval_s = interval_s
        self.on_retry = on_retry
        self.pool_id: str | None = None
        self.dirty: tuple[StepBatch, str | None] | None = None
        self.memory = _Memory(self)
        self.executor = _Executor(self)

    def reserve(self, plan: Plan) -> ReserveResult:
        if self.dirty is not None:
            batch, pool = self.dirty
            try:
                self._retry("execute", lambda: self._execute(batch, pool))
            except PoolChanged:
                pass
            self.dirty = None
        result = self._retry("reserve", lambda: self.inner_memory.reserve(plan))
        self.pool_id = getattr(self.inner_memory, "pool_id", None)
        return result

    def execute(self, batch: StepBatch) -> list[SampleOutput]:
        pool = self.pool_id
        try:
            return self._retry("execute", lambda: self._execute(batch, pool))
        except PoolChanged:
            raise
        except grpc.RpcError as e:
            if _code(e) in RETRYABLE:
                self.dirty = (batch, pool)
            raise

    def _execute(self, batch: StepBatch, pool: str | None) -> list[SampleOutput]:
        if pool is None:
            return self.inner_executor.execute(batch)
        try:
            return self.inner_executor.execute(batch, pool_id=pool)
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


class _Memory:
    """The MemoryClient face of StepRetry (reserve retried; the rest passed through)."""

    def __init__(self, retry: StepRetry):
        self._retry = retry

    def reserve(self, plan: Plan) -> ReserveResult:
        return self._retry.reserve(plan)

    def __getattr__(self, name):
        return getattr(self._retry.inner_memory, name)


class _Executor:
    """The ExecutorClient face of StepRetry."""

    def __init__(self, retry: StepRetry):
        self._retry = retry

    def execute(self, batch: StepBatch) -> list[SampleOutput]:
        return self._retry.execute(batch)

    def __getattr__(self, name):
        return getattr(self._retry.inner_executor, name)
