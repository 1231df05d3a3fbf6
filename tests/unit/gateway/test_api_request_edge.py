"""The gRPC API's requests checked at the edge (pagedserve.gateway.api_request, pagedserve.gateway.request_limits):
sampling fields against their declarations, prompts refused by their size before they are
tokenized, lists bounded; and the parse pool that runs it all off the event loop."""
import asyncio
import threading
from types import SimpleNamespace

import grpc
import pytest

from pagedserve.gateway import request_limits
from pagedserve.gateway.api_request import ApiError, chat_prompt, generate_prompt, sampling_from_proto
from pagedserve.gateway.parse_pool import ParsePool
from pagedserve.wire.v1 import generation_pb2 as pb


class CountingTokenizer:
    """One character a token; its longest vocabulary entry is 4 bytes, so 16 bytes a token."""

    chat_template = "{{ messages }}"

    def __init__(self):
        self.calls = 0

    def get_vocab(self):
        return {"a": 0, "b": 1, "abcd": 2}

    def encode(self, text, add_special_tokens=False):
        self.calls += 1
        return [ord(c) % 3 for c in text]

    def apply_chat_template(self, messages, **kw):
        self.calls += 1
        return [0] * sum(len(m["content"]) + 1 for m in messages)


@pytest.mark.parametrize("sampling,words", [
    (pb.SamplingParams(beam_width=2, length_penalty=1000), "length_penalty must be between -46.5 and 46.5"),
    (pb.SamplingParams(beam_width=2, length_penalty=-1000), "length_penalty must be between -46.5 and 46.5"),
    (pb.SamplingParams(temperature=1000), "temperature must be in [0, 100]"),
    (pb.SamplingParams(top_p=1e-46), "top_p must be in (0, 1]"),  # 0 once a float32
    (pb.SamplingParams(seed=2 ** 64 - 1), "seed must be between 0 and 9223372036854775807"),
    (pb.SamplingParams(stop=["s"] * 33), "stop must hold at most 32 items"),
    (pb.SamplingParams(stop_token_ids=[1] * 129), "stop_token_ids must hold at most 128 items"),
    (pb.SamplingParams(guided_kind="xml"), "guided_kind must be one of"),
    (pb.SamplingParams(max_tokens=2049), "max_tokens=2049 exceeds the model's maximum length 2048"),
])
def test_sampling_is_checked_against_its_declaration(sampling, words):
    with pytest.raises(ApiError) as e:
        sampling_from_proto(sampling, 2048)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and words in e.value.message


def test_a_prompt_too_large_for_the_model_is_refused_before_it_is_tokenized():
    tok = CountingTokenizer()
    assert request_limits.bytes_per_token(tok) == 16
    assert generate_prompt(SimpleNamespace(prompt="a" * 160, prompt_token_ids=[]), tok, 10)
    assert tok.calls == 1
    with pytest.raises(ApiError) as e:
        generate_prompt(SimpleNamespace(prompt="é" * 81, prompt_token_ids=[]), tok, 10)  # 162 bytes
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and tok.calls == 1
    assert "prompt is 162 bytes" in e.value.message and "at most 160 bytes" in e.value.message
    assert generate_prompt(SimpleNamespace(prompt="a" * 161, prompt_token_ids=[]), tok)  # no model: no bound


def test_chat_messages_are_bounded_in_number_and_size():
    tok = CountingTokenizer()
    turn = SimpleNamespace(role="user", content="a" * 80)
    assert chat_prompt(SimpleNamespace(messages=[turn, turn]), tok, 10)
    with pytest.raises(ApiError) as e:
        chat_prompt(SimpleNamespace(messages=[turn, turn, turn]), tok, 10)
    assert "messages (their contents together) is 240 bytes" in e.value.message and tok.calls == 1
    many = [SimpleNamespace(role="user", content="")] * (request_limits.MAX_MESSAGES + 1)
    with pytest.raises(ApiError) as e:
        chat_prompt(SimpleNamespace(messages=many), tok, 10)
    assert f"at most {request_limits.MAX_MESSAGES} messages" in e.value.message and tok.calls == 1


def test_a_tokenizer_that_lists_no_vocabulary_sets_no_bound():
    assert request_limits.bytes_per_token(object()) is None
    request_limits.check_prompt_bytes(10 ** 9, 2, object(), "prompt")


def test_the_parse_pool_runs_work_off_the_event_loop():
    pool = ParsePool(workers=2)
    loop_ran = threading.Event()

    def blocking():  # would deadlock on the loop's own thread: the loop must set the event
        return loop_ran.wait(30)

    async def main():
        work = asyncio.ensure_future(pool.run(blocking))
        await asyncio.sleep(0)
        loop_ran.set()
        return await work, await pool.run(sum, [1, 2])

    try:
        assert asyncio.run(main()) == (True, 3)
        with pytest.raises(ZeroDivisionError):
            asyncio.run(pool.run(lambda: 1 / 0))
    finally:
        pool.close()
