"""A draining gateway (pagedserve.gateway.server.Gateway.drain, what SIGTERM starts), both APIs at once,
in process over the fake executor: health NOT_SERVING, new requests UNAVAILABLE / HTTP 503
with Retry-After, the running streams of both APIs finish with every token; those still
running at the deadline end with UNAVAILABLE / an error event and `data: [DONE]`."""
import asyncio
import json

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.gateway.openai.server import start_openai
from pagedserve.gateway.scheduler_config import SchedulerConfig
from pagedserve.gateway.server import SERVICE
from pagedserve.gateway.tokenizer import load_tokenizer
from pagedserve.memsvc.memory_manager import MemoryConfig, MemoryManager
from pagedserve.wire.v1 import generation_pb2 as pb
from tests.support.fake_executor import VOCAB, SlowExecutor
from tests.support.gateway_harness import GatewayThread, Serialized, greedy, in_process
from tests.support.tiny_models import save_tiny_tokenizer

STEP_DELAY = 0.01


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    save_tiny_tokenizer(path, vocab_size=VOCAB)
    return load_tokenizer(str(path))


@pytest.fixture
def served(tokenizer):
    executor = SlowExecutor(4, 8192, delay=STEP_DELAY)
    memory = Serialized(MemoryManager(MemoryConfig(num_blocks=8192, max_model_len=8192)))
    executor.attach_pool(memory.register_executor(executor.info.kv))
    g = GatewayThread(in_process(memory, executor, tokenizer),
                      SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, overlap=False))
    http = g._call(start_openai(g.gateway, "127.0.0.1", 0))
    g.wait_ready()
    g.url = f"http://127.0.0.1:{http.port}"
    yield g
    g._call(http.stop())
    g.close()


def grpc_stream(g, max_tokens):
    return g.stub.Generate(pb.GenerateRequest(prompt_token_ids=[5, 6, 7],
                                              sampling=greedy(max_tokens, ignore_eos=True)), timeout=60)


def http_stream(g, client, max_tokens):
    body = {"prompt": "w5 w6 w7", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    return client.stream("POST", g.url + "/v1/completions", json=body)


def data_lines(response):
    return (line[len("data: "):] for line in response.iter_lines() if line.startswith("data: "))


def start_drain(g, timeout):
    return asyncio.run_coroutine_threadsafe(g.gateway.drain(timeout), g.loop)


def health(g, service):
    return health_pb2_grpc.HealthStub(g.channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                       timeout=5).status


def test_running_streams_of_both_apis_finish_while_new_requests_are_refused(served):
    g = served
    with httpx.Client(timeout=60) as client, http_stream(g, client, 200) as response:
        events = data_lines(response)
        http_first = next(events)
        grpc_out = grpc_stream(g, 100)  # ends first: the HTTP stream alone keeps the drain going
        grpc_tokens = list(next(grpc_out).token_ids)
        drained = start_drain(g, 60)
        assert health(g, "") == health(g, SERVICE) == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as refused:
            list(grpc_stream(g, 4))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in refused.value.details()
        late = client.post(g.url + "/v1/completions", json={"prompt": "w5", "max_tokens": 2})
        assert late.status_code == 503 and late.headers["retry-after"] == "1"
        assert "shutting down" in late.json()["error"]["message"]
        assert client.get(g.url + "/health").status_code == 503
        assert not drained.done()  # both streams still run
        finish = None
        for r in grpc_out:
            grpc_tokens += r.token_ids
            finish = r.finish_reason or finish
        assert (len(grpc_tokens), finish) == (100, "length")
        rest = [http_first, *events]
    assert rest[-1] == "[DONE]"
    chunks = [json.loads(e) for e in rest[:-1]]
    assert not any("error" in c for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 200
    assert drained.result(30) == 0


def test_streams_still_running_at_the_deadline_end_with_an_error_not_a_cut(served):
    g = served
    with httpx.Client(timeout=60) as client, http_stream(g, client, 5000) as response:
        events = data_lines(response)
        first = next(events)
        grpc_out = grpc_stream(g, 5000)
        next(grpc_out)
        assert start_drain(g, 0.3).result(30) == 2
        with pytest.raises(grpc.RpcError) as ended:
            list(grpc_out)
        rest = [first, *events]
    assert ended.value.code() == grpc.StatusCode.UNAVAILABLE and "--drain-timeout" in ended.value.details()
    assert rest[-1] == "[DONE]"
    error = json.loads(rest[-2])["error"]
    assert "--drain-timeout" in error["message"] and error["code"] == "service_unavailable"
    assert not any(json.loads(e).get("choices", [{}])[0].get("finish_reason") for e in rest[:-2])
    assert g.runner.in_flight() == 0 and not g.runner.loop.requests
