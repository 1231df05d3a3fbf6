"""The OpenAI HTTP API of a running `pagedserve serve` (three real processes, the default
model), through the official `openai` client: completions and chat, streaming and not,
n = 2, stop strings, seeds, greedy output identical to the gRPC API's, error statuses,
and a disconnect mid-stream that frees every block."""
import time
from types import SimpleNamespace

import grpc
import openai
import pytest

from pagedserve.wire.v1 import generation_pb2 as pb
from pagedserve.wire.v1 import generation_pb2_grpc as pb_grpc
from pagedserve.wire.v1 import memory_pb2, memory_pb2_grpc
from tests.support.gateway_harness import collect, greedy
from tests.support.serve_procs import TOKEN, serving_http
from pagedserve.rpc.grpc_service import open_channel

KEY = "test-key"
MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"
AUTH = [("authorization", f"Bearer {KEY}")]  # the key may guard the gRPC API too


@pytest.fixture(scope="module")
def served():
    with serving_http("--kv-tokens", "4096", "--max-num-seqs", "8", "--api-key", KEY) as serve:
        channels = [grpc.insecure_channel(f"127.0.0.1:{serve.port}"),
                    open_channel(f"127.0.0.1:{serve.memsvc_port}", token=TOKEN)]
        try:
            yield SimpleNamespace(
                url=serve.url, stub=pb_grpc.GenerationStub(channels[0]),
                client=openai.OpenAI(base_url=serve.url + "/v1", api_key=KEY, max_retries=0, timeout=120),
                memory=memory_pb2_grpc.MemoryManagerStub(channels[1]))
        finally:
            for c in channels:
                c.close()


def referenced(served) -> int:
    return served.memory.Stats(memory_pb2.StatsRequest(), timeout=5).blocks_referenced


def test_models_and_greedy_output_identical_to_grpc(served):
    assert [m.id for m in served.client.models.list().data] == [MODEL]
    want = collect(served.stub.Generate(pb.GenerateRequest(prompt=PROMPT, sampling=greedy(8)), timeout=120,
                                        metadata=AUTH))[0]
    r = served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert r.choices[0].text == want["text"] and r.choices[0].finish_reason == want["finish_reason"]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == want["usage"][:2]

    question = "What is the capital of France?"
    want = collect(served.stub.Chat(pb.ChatRequest(messages=[pb.ChatMessage(role="user", content=question)],
                                                   sampling=greedy(8)), timeout=120, metadata=AUTH))[0]
    c = served.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                              max_tokens=8, temperature=0)
    assert c.choices[0].message.content == want["text"]
    assert (c.usage.prompt_tokens, c.usage.completion_tokens) == want["usage"][:2]


def test_streaming_equals_whole_and_reports_usage(served):
    whole = served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    chunks = list(served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                                   stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6

    messages = [{"role": "user", "content": "Say hello."}]
    whole = served.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    parts = list(served.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                                       temperature=0, stream=True))
    assert "".join(p.choices[0].delta.content or "" for p in parts) == whole.choices[0].message.content
    assert parts[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_n_2_seeds_and_stop_strings(served):
    ask = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0, n=2, seed=1234)
    a, b = served.client.completions.create(**ask), served.client.completions.create(**ask)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert 2 <= a.usage.completion_tokens <= 16
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "Name a color."}], max_tokens=6,
                temperature=0.9, n=2, seed=7)
    x, y = served.client.chat.completions.create(**chat), served.client.chat.completions.create(**chat)
    assert [c.message.content for c in x.choices] == [c.message.content for c in y.choices]

    greedy8 = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    text = served.client.completions.create(**greedy8).choices[0].text
    stop = text.strip().split()[1]
    cut = served.client.completions.create(**greedy8, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == text[:text.index(stop)]


def test_error_statuses(served):
    with pytest.raises(openai.BadRequestError) as e:
        served.client.completions.create(model=MODEL, prompt=PROMPT, top_p=1.5)
    assert e.value.status_code == 400 and e.value.body["param"] == "top_p"
    with pytest.raises(openai.AuthenticationError) as e:
        openai.OpenAI(base_url=served.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert e.value.status_code == 401
    with pytest.raises(openai.NotFoundError) as e:
        served.client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "Hi"}])
    assert e.value.status_code == 404 and e.value.body["code"] == "model_not_found"


def test_disconnect_mid_stream_frees_every_block(served):
    streams = [served.client.completions.create(model=MODEL, prompt=f"Count to a thousand, part {i}:",
                                                max_tokens=1000, temperature=0, stream=True,
                                                extra_body={"ignore_eos": True}) for i in range(3)]
    for s in streams:
        next(iter(s))
    assert referenced(served) > 0
    for s in streams:
        s.close()
    deadline = time.monotonic() + 5
    while referenced(served) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert referenced(served) == 0


def test_beam_search_extension_returns_the_best_beams_first(served):
    r = served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, n=2, logprobs=0,
                                         extra_body={"beam_width": 3})
    assert [c.index for c in r.choices] == [0, 1] and r.choices[0].text != r.choices[1].text
    scores = [sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in r.choices]
    assert scores[0] >= scores[1]
