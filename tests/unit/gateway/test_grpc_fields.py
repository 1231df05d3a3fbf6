"""Every field of the gRPC API's requests is acted on or refused by name, as the HTTP API's
(tests/unit/gateway/test_request_fields.py): each SamplingParams field reaches the sampling,
each request field is listed with where it is read, and a field this gateway's proto lacks
(a client built from a newer generation.proto) is INVALID_ARGUMENT naming its number and
where it sits, through the real gRPC server."""
import grpc
import pytest

from pagedserve.gateway.scheduler_config import SchedulerConfig
from pagedserve.memsvc.memory_manager import MemoryConfig, MemoryManager
from pagedserve.wire import convert
from pagedserve.wire.v1 import generation_pb2 as pb
from tests.support.fake_executor import FakeExecutor
from tests.support.gateway_harness import GatewayThread, Serialized, collect, greedy, in_process

READ_BY = {  # request message -> its fields -> where the gateway acts on each
    "GenerateRequest": {"prompt": "api_request.generate_prompt", "prompt_token_ids": "api_request.generate_prompt",
                        "model": "api_request.check_model", "sampling": "api_request.sampling_from_proto",
                        "priority": "the scheduler's queue order", "request_id": "GenerateResponse.request_id",
                        "cache_salt": "the prefix cache's namespace"},
    "ChatRequest": {"messages": "api_request.chat_prompt", "model": "api_request.check_model",
                    "sampling": "api_request.sampling_from_proto", "priority": "the scheduler's queue order",
                    "request_id": "GenerateResponse.request_id", "cache_salt": "the prefix cache's namespace",
                    "chat_template_kwargs": "chat_template.kwargs_of_proto"},
    "ChatMessage": {"role": "the chat template", "content": "the chat template"},
    "TokenizeRequest": {"text": "the tokenizer", "model": "api_request.check_model",
                        "add_special_tokens": "the tokenizer"},
    "ListModelsRequest": {},
}

ODD = {"max_tokens": 7, "temperature": 0.5, "top_p": 0.5, "top_k": 5, "min_p": 0.25, "seed": 3, "stop": ["x"],
       "stop_token_ids": [4], "n": 2, "ignore_eos": True, "logprobs": 2, "repetition_penalty": 1.5,
       "presence_penalty": 0.5, "frequency_penalty": 0.5, "beam_width": 2, "length_penalty": 0.5,
       "early_stopping": True, "guided_kind": "regex", "guided_spec": "a", "prompt_logprobs": 1,
       "min_tokens": 1, "logit_bias": {3: 1.0}}


def test_every_request_field_is_read_somewhere():
    for name, fields in READ_BY.items():
        assert set(pb.DESCRIPTOR.message_types_by_name[name].fields_by_name) == set(fields), (
            f"a field of {name} was added or removed: say where the gateway reads it, or refuse it")


def test_each_sampling_field_reaches_the_sampling_params():
    assert set(ODD) == set(pb.SamplingParams.DESCRIPTOR.fields_by_name)
    plain = convert.sampling_from_proto(pb.SamplingParams())
    for name, value in ODD.items():
        got = convert.sampling_from_proto(pb.SamplingParams(**{name: value}))
        assert getattr(got, name) == value != getattr(plain, name), name


@pytest.fixture(scope="module")
def g():
    executor = FakeExecutor(4, 512)
    memory = Serialized(MemoryManager(MemoryConfig(num_blocks=256, max_model_len=512)))
    executor.attach_pool(memory.register_executor(executor.info.kv))
    g = GatewayThread(in_process(memory, executor), SchedulerConfig(max_num_seqs=4, overlap=False))
    g.wait_ready()
    yield g
    g.close()


def varint(n: int) -> bytes:
    out = b""
    while True:
        out += bytes([(n & 0x7F) | (0x80 if n > 0x7F else 0)])
        n >>= 7
        if not n:
            return out


def unknown(number: int) -> bytes:
    """A field `number` (varint 1), which no request message declares."""
    return varint(number << 3) + b"\x01"


def nested(number: int, body: bytes) -> bytes:
    return varint(number << 3 | 2) + varint(len(body)) + body


def call(g, method: str, raw: bytes):
    """The details of the error that `raw` bytes sent to `method` get."""
    streams = method in ("Generate", "Chat")
    rpc = (g.channel.unary_stream if streams else g.channel.unary_unary)(f"/pagedserve.v1.Generation/{method}")
    with pytest.raises(grpc.RpcError) as e:
        list(rpc(raw, timeout=30)) if streams else rpc(raw, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    return e.value.details()


def test_a_field_this_gateway_does_not_know_is_refused_by_its_number_and_place(g):
    request = pb.GenerateRequest(prompt_token_ids=[1, 2], sampling=greedy(2)).SerializeToString()
    said = call(g, "Generate", request + unknown(99))
    assert said.startswith("the request: field number 99 is not a field of pagedserve.v1.GenerateRequest")
    sampling = greedy(2).SerializeToString() + unknown(77)
    said = call(g, "Generate", request + nested(4, sampling))  # sampling is field 4
    assert said.startswith("sampling: field number 77 is not a field of pagedserve.v1.SamplingParams")
    messages = [pb.ChatMessage(role="user", content="hi").SerializeToString(),
                pb.ChatMessage(role="user", content="hi").SerializeToString() + unknown(9)]
    said = call(g, "Chat", b"".join(nested(1, m) for m in messages))
    assert said.startswith("messages[1]: field number 9 is not a field of pagedserve.v1.ChatMessage")
    assert "field number 5" in call(g, "Tokenize", pb.TokenizeRequest(text="x").SerializeToString() + unknown(5))
    assert "field number 1" in call(g, "ListModels", unknown(1))
    out = collect(g.stub.Generate(pb.GenerateRequest(prompt_token_ids=[1, 2], sampling=greedy(2)), timeout=30))
    assert len(out[0]["token_ids"]) == 2  # the requests it knows go on


def test_a_request_id_is_bounded_as_it_is_echoed_in_every_message(g):
    said = call(g, "Generate", pb.GenerateRequest(prompt_token_ids=[1], request_id="r" * 1025).SerializeToString())
    assert said.startswith("request_id must") and "at most 1024 characters" in said
    out = collect(g.stub.Generate(pb.GenerateRequest(prompt_token_ids=[1], request_id="r" * 1024,
                                                     sampling=greedy(1)), timeout=30))
    assert out[0]["request_id"] == "r" * 1024
