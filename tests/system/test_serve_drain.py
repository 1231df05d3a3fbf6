"""SIGTERM to a real `pagedserve serve` (the default model) with a stream running on each API:
the gateway drains before the executor and memsvc are stopped, so both streams get every
token and end normally ([DONE] / OK), a new request meanwhile gets HTTP 503 / UNAVAILABLE,
and serve exits 0 leaving no shared memory. With a tiny --drain-timeout the streams end with
an error instead (an error event and `data: [DONE]`; UNAVAILABLE), never a cut connection."""
import json
import signal
import threading
import time

import grpc
import httpx

from pagedserve.wire.v1 import generation_pb2 as pb
from pagedserve.wire.v1 import generation_pb2_grpc as pb_grpc
from tests.support.gateway_harness import greedy
from tests.support.health import NOT_SERVING, wait_for_health
from tests.support.serve_procs import alive, children, segments, serving_http

PROMPT = "Once upon a time"


class Streams:
    """One HTTP and one gRPC completion of `max_tokens` (greedy, ignore_eos), each on a thread."""

    def __init__(self, serve, max_tokens: int):
        self.serve, self.max_tokens = serve, max_tokens
        self.http_events: list[str] = []
        self.grpc_tokens: list[int] = []
        self.grpc_finish, self.grpc_status, self.http_error = None, None, None
        self.threads = [threading.Thread(target=self._http), threading.Thread(target=self._grpc)]
        for t in self.threads:
            t.start()

    def _http(self) -> None:
        body = {"prompt": PROMPT, "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        try:
            with httpx.stream("POST", self.serve.url + "/v1/completions", json=body, timeout=600) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.http_events.append(line[len("data: "):])
        except httpx.HTTPError as e:  # a cut connection
            self.http_error = e

    def _grpc(self) -> None:
        with grpc.insecure_channel(f"127.0.0.1:{self.serve.port}") as channel:
            request = pb.GenerateRequest(prompt=PROMPT, sampling=greedy(self.max_tokens, ignore_eos=True))
            try:
                for r in pb_grpc.GenerationStub(channel).Generate(request, timeout=600):
                    self.grpc_tokens += r.token_ids
                    self.grpc_finish = r.finish_reason or self.grpc_finish
                self.grpc_status = grpc.StatusCode.OK
            except grpc.RpcError as e:
                self.grpc_status = (e.code(), e.details())

    def wait_started(self, tokens: int = 8, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while len(self.http_events) < tokens or len(self.grpc_tokens) < tokens:
            assert time.monotonic() < deadline, "the streams did not start"
            time.sleep(0.05)

    def join(self) -> None:
        for t in self.threads:
            t.join(600)

    def http_chunks(self) -> list[dict]:
        assert self.http_error is None, f"the HTTP stream was cut: {self.http_error!r}"
        assert self.http_events[-1] == "[DONE]"
        return [json.loads(e) for e in self.http_events[:-1]]


def sigterm(serve) -> list[int]:
    """SIGTERM to serve; the pids of its three services."""
    pids = children(serve.proc.pid)
    assert len(pids) == 3
    serve.proc.send_signal(signal.SIGTERM)
    return pids


def assert_stopped_clean(serve, pids) -> None:
    assert serve.proc.wait(120) == 0
    assert not [p for p in pids if alive(p)] and segments(pids) == []


def test_sigterm_lets_running_streams_of_both_apis_finish_then_stops_everything():
    with serving_http("--drain-timeout", "300") as serve:
        streams = Streams(serve, max_tokens=200)
        streams.wait_started()
        pids = sigterm(serve)
        wait_for_health(f"127.0.0.1:{serve.port}", NOT_SERVING, "pagedserve.v1.Generation", timeout=30,
                        interval=0.05)
        late = httpx.post(serve.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=30)
        assert late.status_code == 503 and late.headers["retry-after"] == "1"
        with grpc.insecure_channel(f"127.0.0.1:{serve.port}") as channel:
            try:
                list(pb_grpc.GenerationStub(channel).Generate(
                    pb.GenerateRequest(prompt=PROMPT, sampling=greedy(2)), timeout=30))
                refused = None
            except grpc.RpcError as e:
                refused = e.code()
        assert refused == grpc.StatusCode.UNAVAILABLE
        streams.join()
        chunks = streams.http_chunks()
        assert not [c for c in chunks if "error" in c]
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
        assert chunks[-1]["usage"]["completion_tokens"] == 200
        assert streams.grpc_status == grpc.StatusCode.OK
        assert (len(streams.grpc_tokens), streams.grpc_finish) == (200, "length")
        assert_stopped_clean(serve, pids)


def test_streams_still_running_at_a_tiny_drain_timeout_end_with_an_error_then_done():
    with serving_http("--drain-timeout", "1") as serve:
        streams = Streams(serve, max_tokens=4000)
        streams.wait_started()
        pids = sigterm(serve)
        streams.join()
        chunks = streams.http_chunks()
        assert "--drain-timeout" in chunks[-1]["error"]["message"]
        assert not [c for c in chunks[:-1] if "error" in c or c["choices"][0]["finish_reason"]]
        code, details = streams.grpc_status
        assert code == grpc.StatusCode.UNAVAILABLE and "--drain-timeout" in details
        assert len(streams.grpc_tokens) < 4000
        assert_stopped_clean(serve, pids)
