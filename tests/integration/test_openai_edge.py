"""Nothing a client sends can harm another request: through the HTTP app and the gRPC API in
process (model-free executor, the default model's tokenizer), every input out of what the
proto carries, or not finite as float32, or not UTF-8, or too big, is a 400 naming the
parameter / INVALID_ARGUMENT naming the field, and the gateway keeps serving; requests are
read off the event loop, so /health and gRPC health answer while one is being tokenized."""
import json
import threading

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.openai_server import Server
from tests.support.gateway_harness import collect
from pagedserve.wire.v1 import generation_pb2 as pb


ASK = [{"role": "user", "content": "Hi"}]
BAD = [
    ('{"prompt": "Hi", "top_k": 2147483648}', "top_k"),
    ('{"prompt": "Hi", "stop_token_ids": [1099511627776]}', "stop_token_ids[0]"),
    ('{"prompt": "Hi", "stop": ["\\ud800"]}', "stop[0]"),
    ('{"prompt": "Hi", "seed": 18446744073709551616}', "seed"),
    ('{"prompt": "Hi", "priority": 2147483648}', "priority"),
    ('{"prompt": "Hi", "n": 4294967296}', "n"),
    ('{"prompt": "Hi", "logprobs": 4294967296}', "logprobs"),
    ('{"prompt": "Hi", "max_tokens": 4294967296}', "max_tokens"),
    ('{"prompt": "Hi", "beam_width": 2, "length_penalty": 1000}', "length_penalty"),
    ('{"prompt": "Hi", "beam_width": 2, "length_penalty": -1000}', "length_penalty"),
    ('{"prompt": "\\ud800"}', "prompt"),
    ('{"prompt": "Hi", "top_p": 1e-46, "logprobs": 1}', "top_p"),
    ('{"prompt": "Hi", "temperature": 1e39}', "temperature"),
    ('{"prompt": "Hi", "cache_salt": "\\udc00"}', "cache_salt"),
    ('{"prompt": "Hi", "stop": ' + json.dumps(["s"] * 33) + "}", "stop"),
    ('{"prompt": ' + json.dumps(["Hi"] * 129) + "}", "prompt"),
    ('{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}, '
     '{"role": "assistant", "tool_calls": ["call"]}], "tools": [{"type": "function", "function": '
     '{"name": "f"}}]}', "messages[2].tool_calls[0]"),
    ('{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
    ('{"messages": ' + json.dumps(ASK * 2049) + "}", "messages"),
    ('{"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 4294967296}',
     "top_logprobs"),
]


@pytest.mark.parametrize("raw,param", BAD)
def test_bad_inputs_are_400_naming_the_parameter_and_the_gateway_keeps_serving(server, raw, param):
    path = "/v1/chat/completions" if '"messages"' in raw else "/v1/completions"
    r = httpx.post(server.url + path, content=raw.encode(), timeout=30,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(param), error
    assert error["type"] == "invalid_request_error"


def test_a_body_nested_100000_levels_deep_is_400_naming_the_limit(server):
    raw = '{"prompt": "Hi", "x": ' + "[" * 100_000 + "]" * 100_000 + "}"
    r = httpx.post(server.url + "/v1/completions", content=raw.encode(), timeout=30)
    assert r.status_code == 400 and "more than 64 levels" in r.json()["error"]["message"]
    assert server.client.completions.create(model="fake", prompt="Hi", max_tokens=2).usage.completion_tokens == 2


def test_a_prompt_too_large_for_the_model_is_refused_by_its_size(server):
    r = server.post("/v1/completions", {"prompt": "word " * (600 << 10), "max_tokens": 1})  # 3 MiB
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert "bytes of UTF-8, more than the model's maximum length of 2048 tokens" in r.json()["error"]["message"]
    r = server.post("/tokenize", {"messages": [{"role": "user", "content": "word " * (600 << 10)}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_the_openapi_document_is_served(server):
    doc = httpx.get(server.url + "/openapi.json", timeout=10).json()
    assert doc["openapi"].startswith("3.") and "/v1/chat/completions" in doc["paths"]
    top_k = doc["components"]["schemas"]["CompletionRequest"]["properties"]["top_k"]["anyOf"][0]
    assert top_k["maximum"] == 2 ** 31 - 1


GRPC_BAD = [
    (pb.SamplingParams(beam_width=2, length_penalty=1000), "length_penalty"),
    (pb.SamplingParams(temperature=1e30), "temperature"),
    (pb.SamplingParams(top_p=1e-46), "top_p"),
    (pb.SamplingParams(seed=2 ** 64 - 1), "seed"),
    (pb.SamplingParams(stop=["s"] * 33), "stop"),
    (pb.SamplingParams(stop_token_ids=[7] * 129), "stop_token_ids"),
]


def test_grpc_answers_invalid_argument_naming_the_field(server):
    for sampling, field in GRPC_BAD:
        with pytest.raises(grpc.RpcError) as e:
            list(server.g.stub.Generate(pb.GenerateRequest(prompt="Hi", sampling=sampling), timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith(field)
    for request, words in ((pb.GenerateRequest(prompt="Hi", cache_salt="s" * 1025), "cache_salt"),
                           (pb.GenerateRequest(prompt="word " * (600 << 10)), "prompt is"),
                           (pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="x")] * 2049),
                            "messages must hold at most 2048")):
        call = server.g.stub.Chat if isinstance(request, pb.ChatRequest) else server.g.stub.Generate
        with pytest.raises(grpc.RpcError) as e:
            list(call(request, timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in e.value.details()
    out = collect(server.g.stub.Generate(pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingParams(max_tokens=2))))
    assert out[0]["finish_reason"] == "length"


class HeldTokenizer:
    """The real tokenizer, but `encode` waits until released: a parse that takes as long as a test likes."""

    def __init__(self, real):
        self.real = real
        self.entered = threading.Event()
        self.release = threading.Event()

    def __getattr__(self, name):
        return getattr(self.real, name)

    def __len__(self):
        return len(self.real)

    def encode(self, text, **kw):
        if text.startswith("HOLD"):
            self.entered.set()
            assert self.release.wait(30)
        return self.real.encode(text, **kw)


def test_health_answers_while_a_prompt_is_being_tokenized(tokenizer):
    held = HeldTokenizer(tokenizer)
    s = Server(held)
    try:
        s.g.wait_ready()
        result = {}
        waiting = threading.Thread(target=lambda: result.update(status=s.post(
            "/v1/completions", {"prompt": "HOLD on", "max_tokens": 2}).status_code))
        waiting.start()
        assert held.entered.wait(30)  # its parse is held: the loop must serve the rest meanwhile
        assert httpx.get(s.url + "/health", timeout=10).json() == {"status": "ok"}
        health = health_pb2_grpc.HealthStub(s.g.channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        out = collect(s.g.stub.Generate(pb.GenerateRequest(prompt_token_ids=[1, 2],
                                                           sampling=pb.SamplingParams(max_tokens=2)), timeout=30))
        assert out[0]["finish_reason"] == "length"
        held.release.set()
        waiting.join(30)
        assert result["status"] == 200
    finally:
        held.release.set()
        s.close()
