"""OpenTelemetry across the three services (real processes, real model): one request is
one connected trace from the client's traceparent through the gateway's request span, its
step spans (Reserve, Execute) and memsvc's and the executor's server spans."""
import json
import os
import time

import pytest

from pagedserve.rpc import tracing
from pagedserve.wire.step_feed import FED_UNKNOWN
from pagedserve.wire.v1 import generation_pb2 as pb
from tests.support.gateway_harness import collect, greedy
from tests.support.reliability_procs import serving_stack

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tracing"))
    with serving_stack(d, fake=False, kv_tokens=2048,
                       env={tracing.TRACE_FILE_ENV: os.path.join(d, "{service}.jsonl")}) as s:
        yield s


def spans(stack, trace_id: str | None, want_request: bool = True, timeout: float = 10.0) -> list[dict]:
    """Every span of `trace_id` (None: of any trace) the three services wrote, once the
    request span is there."""
    deadline = time.monotonic() + timeout
    while True:
        out = []
        for service in ("gateway", "memsvc", "executor"):
            path = os.path.join(stack.log_dir, f"{service}.jsonl")
            if os.path.exists(path):
                with open(path) as f:
                    out += [s for s in map(json.loads, f)
                            if trace_id is None or s["context"]["trace_id"] == "0x" + trace_id]
        if not want_request or any(s["kind"] == "SpanKind.SERVER" and s["name"].endswith(MODEL) for s in out) \
                or time.monotonic() > deadline:
            return out
        time.sleep(0.1)


def ok(span) -> bool:
    return span["status"]["status_code"] != "ERROR"


def service(span) -> str:
    return span["resource"]["attributes"]["service.name"]


def test_one_request_is_one_connected_trace_across_the_three_services(stack):
    md = [("traceparent", f"00-{TRACE_ID}-{CLIENT_SPAN}-01")]
    out = collect(stack.gen.Generate(pb.GenerateRequest(prompt="The capital of France is",
                                                        sampling=greedy(4, top_p=0.9)), timeout=120, metadata=md))
    assert out[0]["finish_reason"] == "length"
    time.sleep(0.5)  # the last Reserve (which frees the sequence) may still be on its way
    got = spans(stack, TRACE_ID)
    [request] = [s for s in got if s["name"] == f"text_completion {MODEL}"]
    assert request["parent_id"] == "0x" + CLIENT_SPAN and request["kind"] == "SpanKind.SERVER"
    a = request["attributes"]
    assert a["gen_ai.operation.name"] == "text_completion" and a["gen_ai.request.model"] == MODEL
    assert a["gen_ai.request.max_tokens"] == 4 and a["gen_ai.request.temperature"] == 0.0
    assert a["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert a["gen_ai.usage.input_tokens"] == out[0]["usage"][0] and a["gen_ai.usage.output_tokens"] == 4
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    assert 0 <= a["gen_ai.latency.time_in_queue"] <= a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]

    rid = request["context"]["span_id"]
    steps = [s for s in got if service(s) == "pagedserve-gateway" and s["kind"] == "SpanKind.CLIENT"]
    reserves = [s for s in steps if s["name"].endswith("/Reserve")]
    executes = [s for s in steps if s["name"].endswith("/Execute") and ok(s)]
    # a step sent ahead whose fed token was not there in time (its predecessor late under
    # load) fails and runs again with its tokens: one more Execute, and only that kind
    resent = [s for s in steps if s["name"].endswith("/Execute") and not ok(s)]
    assert all(FED_UNKNOWN in s["status"]["description"] for s in resent), resent
    assert len(executes) == 4 and len(reserves) >= 4
    for s in steps:
        assert s["parent_id"] == rid
    for s in executes + reserves[:4]:
        assert [link["context"]["span_id"] for link in s["links"]] == [rid]
    first = reserves[0]["attributes"]
    assert first["pagedserve.blocks_allocated"] == 1 and first["pagedserve.preemptions"] == 0
    assert "pagedserve.cached_tokens" in first and first["pagedserve.granted_tokens"] == a["gen_ai.usage.input_tokens"]

    ids = {s["context"]["span_id"]: s for s in got}
    memsvc = [s for s in got if service(s) == "pagedserve-memsvc"]
    executor = [s for s in got if service(s) == "pagedserve-executor" and ok(s)]
    assert len(executor) == 4 and len(memsvc) >= 4
    assert all(ids[s["parent_id"]] in reserves for s in memsvc)
    assert all(ids[s["parent_id"]] in executes for s in executor)
    assert all(s["kind"] == "SpanKind.SERVER" for s in memsvc + executor)
    for s in got:  # every span leads up to the client's span
        while s["parent_id"] in ids:
            s = ids[s["parent_id"]]
        assert s["parent_id"] == "0x" + CLIENT_SPAN


def test_a_request_without_traceparent_starts_its_own_trace(stack):
    before = {s["context"]["trace_id"] for s in spans(stack, None, want_request=False)}
    assert before
    collect(stack.gen.Chat(pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="Hi")],
                                          sampling=greedy(2)), timeout=120))
    time.sleep(0.5)
    with open(os.path.join(stack.log_dir, "gateway.jsonl")) as f:
        chats = [s for s in map(json.loads, f) if s["name"] == f"chat {MODEL}"]
    [chat] = chats
    assert chat["parent_id"] is None and chat["context"]["trace_id"] not in before
    trace_id = chat["context"]["trace_id"][2:]
    assert {service(s) for s in spans(stack, trace_id)} == {
        "pagedserve-gateway", "pagedserve-memsvc", "pagedserve-executor"}


def test_exporters_come_from_the_environment(monkeypatch, tmp_path):
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_TRACES_EXPORTER",
                 "OTEL_SDK_DISABLED", tracing.TRACE_FILE_ENV):
        monkeypatch.delenv(name, raising=False)
    assert tracing._exporters("gateway") == []  # nothing by default
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317")
    [(otlp, batched)] = tracing._exporters("gateway")
    assert type(otlp).__name__ == "OTLPSpanExporter" and batched
    monkeypatch.setenv(tracing.TRACE_FILE_ENV, str(tmp_path / "{service}.jsonl"))
    kinds = {type(e).__name__: e for e, _ in tracing._exporters("memsvc")}
    assert kinds["JsonLinesExporter"].path == str(tmp_path / "memsvc.jsonl")
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert tracing._exporters("gateway") == []
