"""Per-step spans and metrics around the gateway's memsvc and executor clients.

Each Reserve and each Execute of a step is one CLIENT span, a child of the span of the
first request in the step and linked to the spans of all its requests
(RequestTelemetry.step_context). The Reserve span carries what memsvc decided (sequences granted,
tokens, blocks allocated, preemptions by mode, cached prompt tokens, rejections); the
Execute span what ran. The remote call below it carries the span's trace context, so
memsvc's and the executor's server spans are its children. Preemptions are counted and
the first grant of each request is reported as its end of queueing. Which request a
sequence belongs to is asked of `request_of` (the batching loop's BatchLoop.request_of),
never read from the sequence id.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future

from opentelemetry import trace
from opentelemetry.trace import SpanKind

from pagedserve.gateway.request_telemetry import RequestTelemetry
from pagedserve.rpc.tracing import tracer
from pagedserve.wire.clients import ExecutorClient, MemoryClient
from pagedserve.rpc.sent import Sent
from pagedserve.wire.protocol import ModelInfo, PoolStats
from pagedserve.wire.reserve_messages import Plan, ReserveResult
from pagedserve.wire.step_delta import StepDelta
from pagedserve.wire.step_outputs import StepOutputs


def _unknown(seq_id: str) -> str | None:
    return None


def blocks_allocated(result: ReserveResult, block_size: int) -> int:
    """Blocks the grants' new tokens start (a new sequence's cached blocks excluded)."""
    n = 0
    for start, k in zip(result.grants.start_pos, result.grants.num_tokens):
        n += -(-(start + k) // block_size) - -(-start // block_size)
    return n


class ObservedMemory(MemoryClient):
    """`request_of(seq_id)`: the request id of a sequence the loop holds (None: unknown);
    set it once the loop exists."""

    def __init__(self, inner: MemoryClient, telemetry: RequestTelemetry, block_size: int,
                 request_of: Callable[[str], str | None] = _unknown):
        self.inner = inner
        self.telemetry = telemetry
        self.block_size = block_size
        self.request_of = request_of
        self.step = 0

    def reserve(self, plan: Plan) -> Future[ReserveResult]:
        """The Reserve, in its span from now until its answer is read."""
        self.step += 1
        request_of = self.request_of
        parent, links = self.telemetry.step_context(map(request_of, plan.seq_ids()))
        span = tracer().start_span("pagedserve.v1.MemoryManager/Reserve", context=parent,
                                   kind=SpanKind.CLIENT, links=links)
        answer = _sent_in(span, lambda: self.inner.reserve(plan))

        def result() -> ReserveResult:
            with trace.use_span(span, end_on_exit=True):
                result = answer.result()
                modes = [p.mode for p in result.preempted]
                if span.is_recording():  # the attributes cost a pass over the step: only when kept
                    grants = result.grants
                    span.set_attributes({
                        "pagedserve.step": self.step,
                        "pagedserve.plan.sequences": len(plan.run_ids) + len(plan.entries),
                        "pagedserve.plan.new_sequences": len(plan.entries),
                        "pagedserve.plan.freed": len(plan.free),
                        "pagedserve.granted_sequences": len(grants),
                        "pagedserve.granted_tokens": sum(grants.num_tokens),
                        "pagedserve.blocks_allocated": blocks_allocated(result, self.block_size),
                        "pagedserve.cached_tokens": sum(grants.num_cached),
                        "pagedserve.preemptions": len(modes),
                        "pagedserve.preemptions.swap": modes.count("swap"),
                        "pagedserve.preemptions.recompute": modes.count("recompute"),
                        "pagedserve.rejected": len(result.rejected),
                        "pagedserve.waiting": len(result.waiting),
                    })
            for mode in modes:
                self.telemetry.metrics.preemptions.labels(mode).inc()
            if plan.entries:  # only a new entry can be scheduled for the first time
                self.telemetry.scheduled(map(request_of, result.grants.seq_ids), time.monotonic())
            return result
        return Sent(result)

    def free(self, seq_ids: list[str]) -> None:
        self.inner.free(seq_ids)

    def tables(self, seq_ids: list[str]) -> list[list[int]]:
        return self.inner.tables(seq_ids)

    def fork(self, parent_id: str, child_id: str) -> None:
        self.inner.fork(parent_id, child_id)

    def stats(self) -> PoolStats:
        return self.inner.stats()


class ObservedExecutor(ExecutorClient):
    """Shares the step count and `request_of` of the ObservedMemory of the same loop."""

    def __init__(self, inner: ExecutorClient, telemetry: RequestTelemetry, memory: ObservedMemory):
        self.inner = inner
        self.telemetry = telemetry
        self.memory = memory

    def model_info(self) -> ModelInfo:
        return self.inner.model_info()

    def step(self, batch: StepDelta) -> Future[StepOutputs]:
        """The Execute, in its span from now until its answer is read."""
        request_of = self.memory.request_of
        ids = batch.seq_ids
        parent, links = self.telemetry.step_context(map(request_of, ids))
        start = time.perf_counter()
        span = tracer().start_span("pagedserve.v1.Executor/Execute", context=parent,
                                   kind=SpanKind.CLIENT, links=links)
        if span.is_recording():
            span.set_attributes({
                "pagedserve.step": self.memory.step, "pagedserve.batch.sequences": len(ids),
                "pagedserve.batch.tokens": len(batch.token_ids), "pagedserve.batch.sampled": sum(batch.sample)})
        answer = _sent_in(span, lambda: self.inner.step(batch))

        def result() -> StepOutputs:
            with trace.use_span(span, end_on_exit=True):
                outputs = answer.result()
            self.telemetry.metrics.step_time.observe(time.perf_counter() - start)
            return outputs
        return Sent(result)


def _sent_in(span, send: Callable[[], Future]) -> Future:
    """`send()` with `span` as the current span (the call carries it); a failure to send
    is raised when the answer is asked for, inside the span, which records it."""
    try:
        with trace.use_span(span, end_on_exit=False, record_exception=False,
                            set_status_on_exception=False):
            return send()
    except Exception as e:  # noqa: BLE001 - raised again by the answer
        failed: Future = Future()
        failed.set_exception(e)
        return failed
