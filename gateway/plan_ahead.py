"""Plan ahead: while step N runs, plan step N + 1 and send its Reserve, so the batching loop
makes step N - 1's deltas while memsvc answers; `answer` waits for the reply (None:
memsvc deferred the plan, or nothing was planned). A memory client that `calls_later`
(the remote one) sends it on the loop's thread and the reply is read there; any other
runs on a helper thread (gateway.step_pipeline). What a plan made ahead
may hold is the scheduler's (`Scheduler.plan(ahead_of=...)`) and memsvc's (`Plan.ahead`).
See docs/ARCHITECTURE.md, "The step path".
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from gateway.scheduler import Scheduler
from gateway.step_pipeline import Later, submit_on_wire
from wire.clients import MemoryClient
from wire.protocol import Plan, ReserveResult
from wire.step_delta import StepDelta


@dataclass
class Ahead:
    """A plan made ahead of the running step, and its Reserve in flight."""

    plan: Plan
    result: Future | Later  # of ReserveResult


class PlanAhead:
    def __init__(self, scheduler: Scheduler, memory: MemoryClient,
                 on_answer: Callable[[Plan, ReserveResult], None] | None = None):
        self.scheduler = scheduler
        self.memory = memory
        self.on_answer = on_answer  # every answer, a deferred one too
        self.calls_later = getattr(memory, "calls_later", False)
        self.num_ahead = 0  # plans reserved ahead, and of them deferred by memsvc
        self.num_deferred = 0
        self._pool: ThreadPoolExecutor | None = None

    def reserve(self, running: StepDelta, prepare: Callable[[Plan], None]) -> Ahead | None:
        """Plan the step after `running` and send its Reserve (`prepare` the plan first);
        None: nothing to reserve."""
        plan = self.scheduler.plan(ahead_of=running)
        if plan is None or plan.empty():
            if plan is not None:
                self.scheduler.deferred(plan)
            return None
        prepare(plan)
        if self.calls_later:
            return Ahead(plan, Later(self.memory.reserve_later(plan)))
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="pagedserve-reserve")
        return Ahead(plan, submit_on_wire(self._pool, self.memory.reserve, plan))

    def answer(self, ahead: Ahead) -> ReserveResult | None:
        """memsvc's answer (its error raised); None if it deferred the plan."""
        result = ahead.result.result()
        if self.on_answer is not None:
            self.on_answer(ahead.plan, result)
        self.num_ahead += 1
        if result.deferred:
            self.scheduler.deferred(ahead.plan)
            self.num_deferred += 1
            return None
        return result

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
