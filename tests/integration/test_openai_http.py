"""The OpenAI HTTP API over the in-process gateway (memsvc in process, the model-free
executor, the default model's tokenizer): request parsing, response and SSE shapes, error
statuses, API key, readiness, disconnects; outputs identical to the gRPC API's."""
import contextlib
import json
import threading
import time

import httpx
import openai
import pytest

from pagedserve.wire.v1 import generation_pb2 as pb
from tests.support.fake_executor import FakeExecutor
from tests.support.gateway_harness import collect
from tests.support.openai_server import BLOCK, Server


def events(response) -> list:
    out = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert out[-1] == "[DONE]"
    return [json.loads(e) for e in out[:-1]]


def grpc_texts(server, prompt, n=1, seed=7, max_tokens=6, chat=False):
    sampling = pb.SamplingParams(max_tokens=max_tokens, seed=seed, n=n)
    if chat:
        req = pb.ChatRequest(messages=[pb.ChatMessage(role="user", content=prompt)], sampling=sampling)
        out = collect(server.g.stub.Chat(req, timeout=30))
    else:
        out = collect(server.g.stub.Generate(pb.GenerateRequest(prompt=prompt, sampling=sampling),
                                             timeout=30))
    return [out[i]["text"] for i in range(n)], out[0]["usage"]


def test_models_health_and_unknown_routes(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    models = server.client.models.list().data
    assert [m.id for m in models] == ["fake"]
    assert server.client.models.retrieve("fake").id == "fake"
    with pytest.raises(openai.NotFoundError):
        server.client.models.retrieve("gpt-4")
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["message"] == "no route /v1/nothing"
    assert httpx.get(server.url + "/v1/completions").status_code == 405


def test_completions_match_grpc_for_several_prompts_and_n_2(server):
    prompts = ["The capital of France is", "Once upon a time"]
    r = server.client.completions.create(model="fake", prompt=prompts, n=2, seed=7, max_tokens=6)
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == "fake"
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    usage_prompt = 0
    for k, p in enumerate(prompts):
        texts, usage = grpc_texts(server, p, n=2)
        assert [r.choices[2 * k + i].text for i in range(2)] == texts
        usage_prompt += usage[0]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.prompt_tokens == usage_prompt and r.usage.completion_tokens == 4 * 6
    assert r.usage.total_tokens == usage_prompt + 24
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_token_id_prompts_and_chat_match_grpc(server, tokenizer):
    ids = tokenizer.encode("Hello there", add_special_tokens=False)
    a = server.client.completions.create(model="fake", prompt=ids, seed=3, max_tokens=5)
    b = server.client.completions.create(model="fake", prompt=[ids, ids], seed=3, max_tokens=5)
    assert a.choices[0].text == b.choices[0].text == b.choices[1].text == grpc_texts(
        server, "Hello there", seed=3, max_tokens=5)[0][0]
    c = server.client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "Hi!"}], seed=5, max_completion_tokens=6)
    assert c.object == "chat.completion" and c.id.startswith("chatcmpl-")
    assert c.choices[0].message.role == "assistant"
    texts, usage = grpc_texts(server, "Hi!", seed=5, chat=True)
    assert c.choices[0].message.content == texts[0]
    assert (c.usage.prompt_tokens, c.usage.completion_tokens) == usage[:2]


def test_streaming_completions_and_chat_with_usage(server):
    want = server.client.completions.create(model="fake", prompt="Once upon a time", n=2, seed=9,
                                            max_tokens=8)
    with httpx.stream("POST", server.url + "/v1/completions", timeout=30, json={
            "prompt": "Once upon a time", "n": 2, "seed": 9, "max_tokens": 8, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        chunks = events(r)
    *body, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 16
    assert all(c["usage"] is None and len(c["choices"]) == 1 for c in body)
    for i in range(2):
        mine = [c["choices"][0] for c in body if c["choices"][0]["index"] == i]
        assert "".join(c["text"] for c in mine) == want.choices[i].text
        assert mine[-1]["finish_reason"] == "length"
        assert all(c["finish_reason"] is None for c in mine[:-1])

    stream = server.client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "Hi!"}], seed=5, max_tokens=6, stream=True)
    parts = list(stream)
    assert parts[0].choices[0].delta.role == "assistant"
    assert parts[-1].choices[0].finish_reason == "length"
    assert "".join(p.choices[0].delta.content or "" for p in parts) == grpc_texts(
        server, "Hi!", seed=5, chat=True)[0][0]


def test_stop_strings_and_logprobs(server):
    full = server.client.completions.create(model="fake", prompt="Once upon a time", seed=9, max_tokens=8)
    text = full.choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut = server.client.completions.create(model="fake", prompt="Once upon a time", seed=9,
                                           max_tokens=8, stop=[stop, "never-seen"])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[:text.index(stop)]
    r = server.client.completions.create(model="fake", prompt="Once upon a time", seed=9, max_tokens=4,
                                         logprobs=0)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 4 and lp.text_offset[0] == 0 and len(lp.top_logprobs) == 4
    c = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                             "max_tokens": 3, "logprobs": True, "top_logprobs": 2})
    content = c.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(set(t) == {"token", "logprob", "bytes", "top_logprobs"} for t in content)


BAD = [
    ({"prompt": "Hi", "temperature": -1}, "temperature"),
    ({"prompt": "Hi", "temperature": "hot"}, "temperature"),
    ({"prompt": "Hi", "top_p": 0}, "top_p"),
    ({"prompt": "Hi", "n": 0}, "n"),
    ({"prompt": "Hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "Hi", "max_tokens": 5000}, "max_tokens"),
    ({"prompt": "Hi", "max_tokens": True}, "max_tokens"),
    ({"prompt": "Hi", "stop": 5}, "stop"),
    ({"prompt": "Hi", "seed": -1}, "seed"),
    ({"prompt": "Hi", "logprobs": 30}, "logprobs"),
    ({"prompt": "Hi", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "Hi", "echo": True, "beam_width": 2}, "echo"),
    ({"prompt": "Hi", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "Hi", "prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt": "Hi", "prompt_logprobs": True}, "prompt_logprobs"),
    ({"prompt": "Hi", "prompt_logprobs": 1, "beam_width": 2}, "prompt_logprobs"),
    ({"prompt": "Hi", "suffix": "x"}, "suffix"),
    ({"prompt": "Hi", "best_of": 3}, "best_of"),
    ({"prompt": "Hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "Hi", "user": 5}, "user"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [10 ** 7]}, "prompt"),
    ({"prompt": [1] * 2048}, "prompt"),
]
BAD_CHAT = [
    ({"messages": []}, "messages"),
    ({"messages": [{"content": "x"}]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
     "response_format"),
    ({"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 1}, "prompt_logprobs"),
]


@pytest.mark.parametrize("body,param", BAD + [(b, p) for b, p in BAD_CHAT])
def test_bad_parameters_are_400_naming_them(server, body, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = server.post(path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert param.split("[")[0] in error["message"]


def test_other_errors_unknown_model_json_and_the_client_exceptions(server):
    r = server.post("/v1/completions", {"model": "gpt-4", "prompt": "Hi"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(server.url + "/v1/completions", content=b"{nope", timeout=10)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    assert server.post("/v1/completions", ["Hi"]).status_code == 400
    with pytest.raises(openai.BadRequestError) as e:
        server.client.completions.create(model="fake", prompt="Hi", temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        server.client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])


def test_beam_search_fields_pass_through_or_are_named():
    from dataclasses import fields

    from pagedserve.gateway.openai.errors import OpenAIError
    from pagedserve.gateway.openai.request import parse_completion
    from pagedserve.wire.protocol import SamplingParams

    info = FakeExecutor(BLOCK).info
    body = {"prompt": [1, 2], "beam_width": 3, "length_penalty": 0.5, "early_stopping": True, "n": 2}
    if "beam_width" in {f.name for f in fields(SamplingParams)}:
        s = parse_completion(body, info, None).sampling
        assert (s.beam_width, s.length_penalty, s.early_stopping, s.n) == (3, 0.5, True, 2)
        with pytest.raises(OpenAIError) as e:
            parse_completion({**body, "beam_width": 99}, info, None)
        assert e.value.param == "beam_width"
    else:
        with pytest.raises(OpenAIError) as e:
            parse_completion(body, info, None)
        assert e.value.status == 400 and e.value.param == "beam_width"


def test_a_request_the_pool_can_never_hold_is_400(tokenizer):
    s = Server(tokenizer, num_blocks=8)
    try:
        s.g.wait_ready()
        for stream in (False, True):
            r = s.post("/v1/completions", {"prompt": "Hi", "max_tokens": 100, "stream": stream})
            assert r.status_code == 400 and "pool" in r.json()["error"]["message"]
        assert s.wait_unreferenced() == 0
    finally:
        s.close()


def test_api_key_and_readiness(tokenizer):
    gate = threading.Event()
    s = Server(tokenizer, api_key="sekret", gate=gate)
    try:
        assert httpx.get(s.url + "/health").status_code == 503
        r = s.post("/v1/completions", {"prompt": "Hi"}, headers={"Authorization": "Bearer sekret"})
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
        gate.set()
        s.g.wait_ready()
        assert httpx.get(s.url + "/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            r = s.post("/v1/completions", {"prompt": "Hi"}, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(s.url + "/v1/models").status_code == 401
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0).models.list()
        assert s.client.completions.create(model="fake", prompt="Hi", max_tokens=2).usage.completion_tokens == 2
    finally:
        s.close()


def test_disconnects_free_the_sequences(tokenizer):
    s = Server(tokenizer, delay=0.02)
    try:
        s.g.wait_ready()
        body = {"prompt": "Count:", "max_tokens": 1000, "ignore_eos": True}  # 20 s to finish
        with httpx.stream("POST", s.url + "/v1/completions", json={**body, "stream": True},
                          timeout=30) as r:
            lines = r.iter_lines()
            next(lines)
            assert s.referenced() > 0
        assert s.wait_unreferenced(timeout=3) == 0
        with pytest.raises(httpx.ReadTimeout):  # not streaming: the client gives up waiting
            s.post("/v1/completions", body, timeout=httpx.Timeout(30, read=0.5))
        assert s.wait_unreferenced(timeout=3) == 0
        assert not s.g.runner.loop.requests
    finally:
        s.close()


def test_a_full_queue_is_429(tokenizer):
    from pagedserve.gateway import step_runner

    if not hasattr(step_runner, "QueueFull"):
        pytest.skip("this StepRunner has no queue bound")
    s = Server(tokenizer, delay=0.02, max_num_seqs=1)
    try:
        s.g.wait_ready()
        s.g.runner.max_waiting = 1
        body = {"prompt": "Count:", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=30) as running:
            lines = running.iter_lines()  # closes the stream when collected
            next(lines)
            def wait_in_queue():
                with contextlib.suppress(httpx.HTTPError):  # cut off when the server stops
                    s.post("/v1/completions", body)

            waiting = threading.Thread(target=wait_in_queue, daemon=True)
            waiting.start()
            deadline = time.monotonic() + 10
            while not s.g.runner.loop.scheduler.waiting and time.monotonic() < deadline:
                time.sleep(0.01)
            r = s.post("/v1/completions", {"prompt": "Hi"})
            assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
            assert r.headers["retry-after"] == "1"
    finally:
        s.close()
