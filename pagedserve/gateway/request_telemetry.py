"""One span and one set of latency figures per public request.

`start` opens the request's SERVER span (a child of the client's traceparent when the
call carried one) with the GenAI request attributes; the step thread reports when a
request is first scheduled (`scheduled`); the server reports what it streams (`streamed`)
and how the request ended (`finish`), which sets the usage, finish reasons and latencies
on the span, ends it, and feeds the metrics. Step spans find their place through
`step_context`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import grpc
from opentelemetry import trace
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from pagedserve.gateway.metrics import GatewayMetrics
from pagedserve.rpc.tracing import extract_context, tracer
from pagedserve.wire.protocol import SamplingParams


@dataclass
class RequestRecord:
    request_id: str
    span: trace.Span
    arrival: float
    prompt_tokens: int
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    output_tokens: int = 0
    finish_reasons: dict[int, str] = field(default_factory=dict)


class RequestTelemetry:
    def __init__(self, metrics: GatewayMetrics):
        self.metrics = metrics
        self.open: dict[str, RequestRecord] = {}
        # sets, not counts: the server's thread adds and the step thread removes (atomic
        # under the GIL); with both empty a step costs no per-request work here
        self.unscheduled: set[str] = set()  # open requests not yet granted a slot
        self.traced: set[str] = set()  # open requests whose span has a valid context

    def start(self, request_id: str, operation: str, model: str, sampling: SamplingParams,
              prompt_tokens: int, metadata=None, public_id: str = "") -> RequestRecord:
        attrs = {
            "gen_ai.operation.name": operation, "gen_ai.system": "pagedserve",
            "gen_ai.request.model": model, "gen_ai.request.max_tokens": sampling.max_tokens,
            "gen_ai.request.temperature": sampling.temperature, "gen_ai.request.top_p": sampling.top_p,
            "gen_ai.request.n": sampling.n, "gen_ai.request.id": public_id or request_id,
            "gen_ai.usage.input_tokens": prompt_tokens,
        }
        if sampling.seed is not None:
            attrs["gen_ai.request.seed"] = sampling.seed
        span = tracer().start_span(f"{operation} {model}", context=extract_context(metadata),
                                   kind=SpanKind.SERVER, attributes=attrs)
        record = RequestRecord(request_id, span, time.monotonic(), prompt_tokens)
        self.open[request_id] = record
        self.unscheduled.add(request_id)
        if span.get_span_context().is_valid:
            self.traced.add(request_id)
        return record

    def step_context(self, request_ids) -> tuple[object, list[Link]]:
        """Where a step's span goes: a child of the first open request's span (so a lone
        request's trace holds its steps), linked to the spans of every request in the step."""
        if not self.traced:  # nothing traced: the step's ids are not walked
            return None, []
        contexts = []
        for rid in dict.fromkeys(request_ids):
            record = self.open.get(rid)
            if record is not None and record.span.get_span_context().is_valid:
                contexts.append(record.span)
        if not contexts:
            return None, []
        parent = trace.set_span_in_context(contexts[0])
        return parent, [Link(s.get_span_context()) for s in contexts]

    def scheduled(self, request_ids, now: float | None = None) -> None:
        """Called by the step thread for the requests granted slots in a step."""
        if not self.unscheduled:
            return
        now = time.monotonic() if now is None else now
        for rid in request_ids:
            record = self.open.get(rid)
            if record is not None and record.scheduled is None:
                record.scheduled = now
                self.unscheduled.discard(rid)

    def streamed(self, record: RequestRecord, deltas) -> None:
        now = time.monotonic()
        for d in deltas:
            if d.token_ids:
                if record.first_token is None:
                    record.first_token = now
                    record.span.add_event("first_token")
                record.last_token = now
                record.output_tokens += len(d.token_ids)
                self.metrics.generation_tokens.inc(len(d.token_ids))
            if d.finish_reason:
                record.finish_reasons[d.index] = d.finish_reason

    def finish(self, record: RequestRecord, code: grpc.StatusCode | None = None, message: str = "") -> None:
        """End the request: `code` None for a finished one, else the status it ended with."""
        if self.open.pop(record.request_id, None) is None:
            return
        self.unscheduled.discard(record.request_id)
        self.traced.discard(record.request_id)
        span, m = record.span, self.metrics
        end = time.monotonic()
        reasons = [record.finish_reasons[i] for i in sorted(record.finish_reasons)]
        span.set_attribute("gen_ai.usage.output_tokens", record.output_tokens)
        span.set_attribute("gen_ai.response.finish_reasons", reasons or ["abort"])
        span.set_attribute("gen_ai.latency.e2e", end - record.arrival)
        if record.scheduled is not None:
            m.prompt_tokens.inc(record.prompt_tokens)
            queued = record.scheduled - record.arrival
            span.set_attribute("gen_ai.latency.time_in_queue", queued)
            m.queue_time.observe(queued)
        if record.first_token is not None:
            ttft = record.first_token - record.arrival
            span.set_attribute("gen_ai.latency.time_to_first_token", ttft)
            m.ttft.observe(ttft)
        if code is None:
            m.e2e.observe(end - record.arrival)
            if record.output_tokens > 1 and record.first_token is not None:
                m.tpot.observe((record.last_token - record.first_token) / (record.output_tokens - 1))
            for reason in reasons:
                m.success.labels(reason).inc()
        else:
            m.errors.labels(code.name).inc()
            span.set_attribute("rpc.grpc.status_code", code.value[0])
            if code is not grpc.StatusCode.CANCELLED:
                span.set_status(Status(StatusCode.ERROR, f"{code.name}: {message}"))
        span.end()
