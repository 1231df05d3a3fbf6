"""Today's request fields through the real HTTP API on the default model (a real executor,
so the sampler's masks act): min_tokens holds back the end of sequence, logit_bias moves the
choice. The schema-wide check (every field honoured or refused) is
tests/unit/gateway/test_request_fields.py."""
import httpx
import openai
import pytest

from pagedserve.gateway.openai.server import start_openai
from pagedserve.gateway.scheduler_config import SchedulerConfig
from pagedserve.gateway.server import Backend
from pagedserve.memsvc.memory_manager import MemoryConfig, MemoryManager
from tests.support.gateway_harness import GatewayThread

ASK = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def served(default_model_dir):
    from pagedserve.executor.executor import Executor
    from pagedserve.gateway.tokenizer import load_tokenizer

    executor = Executor(None)
    tokenizer = load_tokenizer(default_model_dir)
    info = executor.model_info()
    memory = MemoryManager(MemoryConfig(num_blocks=64, max_model_len=info.max_model_len))
    executor.attach_pool(memory.register_executor(info.kv))
    g = GatewayThread(lambda: Backend(memory, executor, tokenizer),
                      SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, overlap=False))
    http = g._call(start_openai(g.gateway, "127.0.0.1", 0))
    g.wait_ready()
    url = f"http://127.0.0.1:{http.port}"
    yield type("S", (), {"url": url, "model": info.name, "tokenizer": tokenizer, "eos": info.eos_token_ids,
                         "client": openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                                                 timeout=300)})
    g._call(http.stop())
    g.close()


def chat(served, **kw):
    return served.client.chat.completions.create(model=served.model, messages=ASK, temperature=0, **kw)


def test_min_tokens_holds_back_the_end_of_sequence(served):
    free = chat(served, max_tokens=60)
    assert free.choices[0].finish_reason == "stop"  # greedy ends early by itself
    short = free.usage.completion_tokens
    held = chat(served, max_tokens=60, extra_body={"min_tokens": short + 10})
    assert held.usage.completion_tokens >= short + 10
    r = httpx.post(served.url + "/v1/completions", timeout=30,
                   json={"prompt": "x", "max_tokens": 4, "min_tokens": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"
    assert "at most max_tokens" in r.json()["error"]["message"]


def test_logit_bias_moves_the_choice(served):
    def first(**kw):
        r = served.client.completions.create(model=served.model, prompt="The capital of France is",
                                             max_tokens=3, temperature=0, logprobs=0, **kw)
        return r.choices[0].logprobs.tokens, r.choices[0].text

    tokens, text = first()
    top = served.tokenizer.encode(text, add_special_tokens=False)[0]
    banned, _ = first(extra_body={"logit_bias": {str(top): -100}})
    assert banned[0] != tokens[0]
    forced = served.tokenizer.encode(" blue", add_special_tokens=False)[0]
    _, text = first(extra_body={"logit_bias": {str(forced): 100}})
    assert served.tokenizer.encode(text, add_special_tokens=False) == [forced] * 3


TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
            "{% if shout %}ANSWER LOUDLY IN CAPITAL LETTERS!\n{% endif %}assistant:")


@pytest.fixture(scope="module")
def templated(default_model_dir, tmp_path_factory):
    """The HTTP and gRPC APIs with --chat-template's file in place of the model's template."""
    from pagedserve.gateway import chat_template
    from pagedserve.gateway.tokenizer import load_tokenizer
    from tests.support.openai_server import Server

    path = tmp_path_factory.mktemp("template") / "shout.jinja"
    path.write_text(TEMPLATE)
    tokenizer = load_tokenizer(default_model_dir)
    tokenizer.chat_template = chat_template.load(str(path))  # as pagedserve.gateway.main does with the flag
    s = Server(tokenizer)
    s.g.wait_ready()
    yield s
    s.close()


def test_chat_template_kwargs_reach_the_template_on_both_apis(templated):
    from google.protobuf.struct_pb2 import Struct

    from pagedserve.wire.v1 import generation_pb2 as pb

    def prompt_tokens(**extra):
        r = templated.post("/v1/chat/completions", {"messages": ASK, "max_tokens": 1, **extra})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    plain, loud = prompt_tokens(), prompt_tokens(chat_template_kwargs={"shout": True})
    assert loud > plain
    count = templated.post("/tokenize", {"messages": ASK, "chat_template_kwargs": {"shout": True}}).json()["count"]
    assert count == loud
    kwargs = Struct()
    kwargs.update({"shout": True})
    out = list(templated.g.stub.Chat(pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="Say hi.")],
                                                    sampling=pb.SamplingParams(max_tokens=1),
                                                    chat_template_kwargs=kwargs), timeout=30))
    assert out[-1].usage.prompt_tokens == loud
    r = templated.post("/v1/chat/completions", {"messages": ASK, "chat_template_kwargs": {"tokenize": False}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


THOUGHT = "<think>\nThe user wants Paris.\n</think>\n\nParis."


@pytest.fixture(scope="module")
def thinking(tokenizer):
    """The HTTP API with --reasoning-parser qwen3 over an executor that writes THOUGHT."""
    from pagedserve.wire.protocol import SampleOutput
    from tests.support.openai_server import Server

    s = Server(tokenizer, gateway_options={"reasoning_parser": "qwen3"})
    script, written = tokenizer.encode(THOUGHT, add_special_tokens=False), {}

    def execute(batch):
        out = []
        for seq_id in (batch.seq_ids[i] for i in batch.sample.nonzero()[0]):
            k = written[seq_id] = written.get(seq_id, -1) + 1
            out.append(SampleOutput(seq_id=seq_id, token_id=script[min(k, len(script) - 1)]))
        return out

    s.executor.execute = execute
    s.script = script
    s.g.wait_ready()
    yield s
    s.close()


def test_reasoning_parser_gives_reasoning_content_whole_and_streamed(thinking):
    kw = {"messages": ASK, "max_tokens": len(thinking.script)}
    r = thinking.post("/v1/chat/completions", kw).json()
    message = r["choices"][0]["message"]
    assert message["reasoning_content"] == "\nThe user wants Paris.\n" and message["content"] == "Paris."
    chunks = list(thinking.client.chat.completions.create(model=r["model"], stream=True, **kw))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    assert reasoning == message["reasoning_content"]
    assert "".join(d.content or "" for d in deltas) == "Paris."
    r = thinking.post("/v1/chat/completions", {**kw, "include_reasoning": False}).json()
    assert "reasoning_content" not in r["choices"][0]["message"]


def grpc_chat(thinking, **sampling):
    from pagedserve.wire.v1 import generation_pb2 as pb

    sampling = pb.SamplingParams(max_tokens=len(thinking.script), **sampling)
    return list(thinking.g.stub.Chat(pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="Say hi.")],
                                                    sampling=sampling), timeout=30))


def test_the_grpc_chat_gives_the_reasoning_in_a_field_of_its_own(thinking):
    body = thinking.post("/v1/chat/completions", {"messages": ASK, "max_tokens": len(thinking.script)}).json()
    message = body["choices"][0]["message"]
    out = grpc_chat(thinking, n=2)
    for index in (0, 1):
        mine = [r for r in out if r.index == index]
        assert "".join(r.reasoning for r in mine) == message["reasoning_content"]  # the same parser
        assert "".join(r.text for r in mine) == message["content"] == "Paris."
        assert [t for r in mine for t in r.token_ids] == thinking.script  # every token still told
        first_text = next(i for i, r in enumerate(mine) if r.text)
        assert not any(r.reasoning for r in mine[first_text:])
        assert mine[-1].finish_reason == "length"
    assert sum(bool(r.reasoning) for r in out) > 2  # streamed in pieces, not held to the end


def test_the_grpc_api_splits_chat_only_and_not_under_a_grammar(thinking):
    from pagedserve.wire.v1 import generation_pb2 as pb

    out = list(thinking.g.stub.Generate(pb.GenerateRequest(prompt="Say hi.", sampling=pb.SamplingParams(
        max_tokens=len(thinking.script))), timeout=30))
    assert "".join(r.text for r in out) == THOUGHT and not any(r.reasoning for r in out)
    out = grpc_chat(thinking, guided_kind="regex", guided_spec="[<a-z/>\\n .A-Z]*")
    assert "".join(r.text for r in out) == THOUGHT and not any(r.reasoning for r in out)


def test_over_http_each_field_not_acted_on_is_a_400_naming_it(server):
    from tests.unit.gateway.test_request_fields import (
        ASKING,
        HONOURED_CHAT,
        OPENAI_CHAT,
        VLLM_CHAT,
    )

    for name in sorted((OPENAI_CHAT | VLLM_CHAT | {"unknown_field"}) - HONOURED_CHAT - {"model"}):
        value, extra = ASKING[name] if isinstance(ASKING[name], tuple) else (ASKING[name], {})
        r = server.post("/v1/chat/completions", {"messages": ASK, "max_tokens": 1, **extra, name: value})
        assert r.status_code == 400, (name, r.text)
        assert r.json()["error"]["param"].split(".")[0].split("[")[0] == name, (name, r.text)
    r = server.post("/v1/chat/completions", {"messages": ASK, "max_tokens": 1, "request_id": "abc"})
    assert r.json()["id"] == "chatcmpl-abc"
    r = server.client.completions.create(model="fake", prompt="x", max_tokens=1, extra_body={"request_id": "x1"})
    assert r.id == "cmpl-x1"


def test_the_grpc_api_takes_min_tokens_and_logit_bias_and_refuses_ids_past_the_vocabulary(server):
    import grpc

    from pagedserve.wire.v1 import generation_pb2 as pb

    out = list(server.g.stub.Generate(pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(
        max_tokens=3, min_tokens=2, logit_bias={5: 1.5})), timeout=30))
    assert out[-1].usage.completion_tokens == 3
    for sampling, words in ((pb.SamplingParams(logit_bias={10 ** 6: 1.0}), "outside the vocabulary"),
                            (pb.SamplingParams(logit_bias={5: 101.0}), "logit_bias[5]"),
                            (pb.SamplingParams(max_tokens=2, min_tokens=3), "min_tokens")):
        with pytest.raises(grpc.RpcError) as e:
            list(server.g.stub.Generate(pb.GenerateRequest(prompt="x", sampling=sampling), timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in e.value.details(), e.value.details()
