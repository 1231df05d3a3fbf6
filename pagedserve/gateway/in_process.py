"""memsvc and the executor as objects in this process, behind the clients' interfaces
(pagedserve.wire.clients), so the batching loop runs them as it runs the gRPC clients.

`InProcessMemory` wraps an object with memsvc's MemoryManager calls (`reserve(plan) ->
ReserveResult`, `free`, `fork`, `stats`): a plan made ahead (`Plan.ahead`) is reserved on a
helper thread, so the loop makes deltas meanwhile; any other before `reserve` returns.
`InProcessExecutor` wraps an object with `model_info()` and `execute(StepBatch) ->
StepOutputs` (pagedserve.executor.Executor, the test fakes) in pagedserve.step.local_engine,
which takes the step message as the executor service does; with `background` (the overlapped
loop) each step runs on one of two helper threads, else before `step` returns. A step sent
while the one numbered before it runs, or that is fed by it, runs only once that one has
succeeded (else it fails as FedTokenUnknown, nothing changed): that one may run again
first (pagedserve.gateway.step_retry), as a failed step across the wire does.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

from pagedserve.step.local_engine import LocalEngine
from pagedserve.wire.clients import ExecutorClient, MemoryClient
from pagedserve.rpc.sent import call_now
from pagedserve.wire.pending_token import PENDING
from pagedserve.wire.protocol import ModelInfo, PoolStats
from pagedserve.wire.reserve_messages import Plan, ReserveResult
from pagedserve.wire.step_delta import StepDelta
from pagedserve.wire.step_feed import FED_UNKNOWN, FedTokenUnknown
from pagedserve.wire.step_outputs import StepOutputs


def submit_started(pool: ThreadPoolExecutor, fn, *args) -> Future:
    """`pool.submit(fn, *args)`, returning once the helper has started it. The helper then
    has the GIL until its call blocks; else it waits for this thread's work, up to the 5 ms
    switch interval."""
    started = threading.Event()

    def call():
        started.set()
        return fn(*args)

    future = pool.submit(call)
    started.wait(1.0)
    return future


class _Helpers:
    def __init__(self, n: int, name: str):
        self.n, self.name = n, name
        self.pool: ThreadPoolExecutor | None = None

    def submit(self, fn, *args) -> Future:
        if self.pool is None:
            self.pool = ThreadPoolExecutor(self.n, thread_name_prefix=self.name)
        return submit_started(self.pool, fn, *args)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None


class InProcessMemory(MemoryClient):
    def __init__(self, inner):
        self.inner = inner
        self._helpers = _Helpers(1, "pagedserve-reserve")

    def reserve(self, plan: Plan) -> Future[ReserveResult]:
        if plan.ahead:
            return self._helpers.submit(self.inner.reserve, plan)
        return call_now(self.inner.reserve, plan)

    def free(self, seq_ids: list[str]) -> None:
        self.inner.free(seq_ids)

    def tables(self, seq_ids: list[str]) -> list[list[int]]:
        return self.inner.tables(seq_ids)

    def fork(self, parent_id: str, child_id: str) -> None:
        self.inner.fork(parent_id, child_id)

    def stats(self) -> PoolStats:
        return self.inner.stats()

    def close(self) -> None:
        self._helpers.close()


class InProcessExecutor(ExecutorClient):
    def __init__(self, inner, background: bool = False):
        self.ordered = LocalEngine(inner)
        self.background = background
        self._helpers = _Helpers(2, "pagedserve-execute")
        self._tries: dict[int, Future] = {}  # step number -> its last try, for the step after it

    def model_info(self) -> ModelInfo:
        return self.ordered.model_info()

    def step(self, step: StepDelta) -> Future[StepOutputs]:
        if not self.background:
            return call_now(self.ordered.execute, step)
        before = self._tries.get(step.step - 1)
        if before is not None and before.done() and not _fed(step):
            before = None
        future = self._helpers.submit(self._after, before, step)
        self._tries = {n: f for n, f in self._tries.items() if n >= step.step - 1}
        self._tries[step.step] = future
        return future

    def _after(self, before: Future | None, step: StepDelta) -> StepOutputs:
        if before is not None and before.exception() is not None:
            raise FedTokenUnknown(f"{FED_UNKNOWN}: step {step.step - 1} failed: send step {step.step}'s tokens")
        return self.ordered.execute(step)

    def close(self) -> None:
        self._helpers.close()


def _fed(step: StepDelta) -> bool:
    return PENDING in step.token_ids


def step_clients(memory, executor, overlap: bool) -> tuple[MemoryClient, ExecutorClient]:
    """`memory` and `executor` as clients: as they are if they are, else wrapped (the
    executor's steps on helper threads when `overlap`)."""
    if not isinstance(memory, MemoryClient):
        memory = InProcessMemory(memory)
    if not isinstance(executor, ExecutorClient):
        executor = InProcessExecutor(executor, background=overlap)
    return memory, executor
