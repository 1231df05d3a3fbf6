"""The OpenAI API's bodies checked at the edge (pagedserve.gateway.openai.json_body, models, request):
every bad input is a 400 naming the parameter (and the allowed range) before anything is
tokenized or queued; the pydantic models take their bounds from pagedserve.wire.sampling_fields and
publish them in the OpenAPI document."""
import json

import pytest

from pagedserve.gateway import request_limits
from pagedserve.gateway.openai import json_body
from pagedserve.gateway.openai.errors import OpenAIError
from pagedserve.gateway.openai.openapi import openapi_document
from pagedserve.gateway.openai.request import detokenize_body, parse_chat, parse_completion, tokenize_body
from pagedserve.wire.protocol import KVGeometry, ModelInfo
from pagedserve.wire.sampling_fields import FIELDS

INFO = ModelInfo("fake", 2048, 1000, [0], None, "", KVGeometry(2, 2, 8, 4))


class FakeTokenizer:
    """One token a character; the longest vocabulary entry is 4 bytes: 16 bytes a token."""

    chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"

    def __init__(self):
        self.calls = 0

    def get_vocab(self):
        return {"a": 0, "abcd": 1}

    def encode(self, text, add_special_tokens=False):
        self.calls += 1
        return [ord(c) % 1000 for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages, **kw):
        self.calls += 1
        return [1] * (1 + sum(len(m.get("content") or "") for m in messages))


def parse(raw: str | bytes | dict, tokenizer=None):
    """Parse a body as the app does: JSON checked, then the route's parser."""
    raw = json.dumps(raw) if isinstance(raw, dict) else raw
    body = json_body.loads(raw.encode() if isinstance(raw, str) else raw)
    route = parse_chat if "messages" in body else parse_completion
    return route(body, INFO, tokenizer or FakeTokenizer())


def refused(raw, tokenizer=None) -> OpenAIError:
    with pytest.raises(OpenAIError) as e:
        parse(raw, tokenizer)
    assert e.value.status == 400
    return e.value


ASK = [{"role": "user", "content": "x"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
BAD = [
    ({"prompt": [1], "top_k": 2 ** 31}, "top_k", "between -1 and 2147483647"),
    ({"prompt": [1], "stop_token_ids": [5, 2 ** 40]}, "stop_token_ids[1]", "between 0 and 4294967295"),
    ('{"prompt": [1], "stop": ["ok", "\\ud800"]}', "stop[1]", "lone surrogate"),
    ('{"prompt": [1], "stop": "\\udfff"}', "stop", "UTF-8"),
    ({"prompt": [1], "seed": 2 ** 64}, "seed", "between 0 and 9223372036854775807"),
    ({"prompt": [1], "priority": 2 ** 31}, "priority", "between -2147483648 and 2147483647"),
    ({"prompt": [1], "n": 2 ** 32}, "n", "between 1 and 128"),
    ({"prompt": [1], "logprobs": 2 ** 32}, "logprobs", "between 0 and 20"),
    ({"prompt": [1], "prompt_logprobs": 2 ** 64}, "prompt_logprobs", "between 0 and 20"),
    ({"prompt": [1], "max_tokens": 2 ** 32}, "max_tokens", "4294967295"),
    ({"prompt": [1], "max_tokens": "5"}, "max_tokens", "an integer"),
    ({"prompt": [1], "max_tokens": True}, "max_tokens", "an integer"),
    ({"prompt": [1], "beam_width": 2, "length_penalty": 1000}, "length_penalty", "-46.5 and 46.5"),
    ({"prompt": [1], "beam_width": 2, "length_penalty": -1000}, "length_penalty", "-46.5 and 46.5"),
    ('{"prompt": "\\ud800"}', "prompt", "lone surrogate"),
    ('{"prompt": ["ok", "a\\ud800"]}', "prompt[1]", "lone surrogate"),
    ({"prompt": [1], "top_p": 1e-46, "logprobs": 1}, "top_p", "0.0 as a 32-bit float"),
    ({"prompt": [1], "temperature": 1e39}, "temperature", "finite 32-bit float"),
    ({"prompt": [1], "temperature": 1000}, "temperature", "[0, 100]"),
    ('{"prompt": [1], "temperature": NaN}', "temperature", "finite"),
    ('{"prompt": [1], "min_p": 1e400}', "min_p", "finite"),
    ({"prompt": [1], "repetition_penalty": 1e-30}, "repetition_penalty", "[0.01, 100]"),
    ({"prompt": [1], "cache_salt": "s" * 1025}, "cache_salt", "at most 1024 characters"),
    ({"prompt": [1], "stop": ["s"] * 33}, "stop", "at most 32 items"),
    ({"prompt": [1], "stop": ["s" * 1025]}, "stop[0]", "at most 1024 characters"),
    ({"prompt": [1], "stop_token_ids": [1] * 129}, "stop_token_ids", "at most 128 items"),
    ({"prompt": ["a"] * 129}, "prompt", "at most 128 prompts"),
    ({"prompt": [[1]] * 129}, "prompt", "at most 128 prompts"),
    ({"prompt": [2 ** 40]}, "prompt", "outside the vocabulary"),
    ({"prompt": [1], "stream_options": 5, "stream": True}, "stream_options", "an object"),
    ('{"prompt": [1], "user": "\\ud800"}', "user", "UTF-8"),
    ('{"prompt": [1], "guided_regex": "a\\ud800"}', "guided_regex", "UTF-8"),
    ('{"prompt": [1], "unknown": {"deep": ["\\udc00"]}}', "unknown.deep[0]", "UTF-8"),
    ('{"prompt": [1], "\\ud800": 1}', None, "a key must be valid UTF-8"),
    ({"messages": ASK + [{"role": "user", "content": "y"}, {"role": "assistant", "tool_calls": [5]}],
      "tools": [TOOL]}, "messages[2].tool_calls[0]", "an object"),
    ({"messages": ASK + [{"role": "assistant", "tool_calls": [{"function": "f"}]}]},
     "messages[1].tool_calls[0].function", "an object"),
    ({"messages": ASK + [{"role": "assistant", "tool_calls": [{"function": {"arguments": 5}}]}]},
     "messages[1].tool_calls[0].function.arguments", "a string (JSON) or an object"),
    ('{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
     "messages[0].content[0].text", "UTF-8"),
    ({"messages": ASK * (request_limits.MAX_MESSAGES + 1)}, "messages", "at most 2048 items"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 257}]},
     "messages[0].content", "at most 256 parts"),
    ({"messages": ASK, "tools": [TOOL] * 129}, "tools", "at most 128 items"),
    ({"messages": ASK, "logprobs": True, "top_logprobs": 2 ** 32}, "top_logprobs", "between 0 and 20"),
    ({"messages": ASK, "max_completion_tokens": 2 ** 32}, "max_completion_tokens", "4294967295"),
    ({"messages": ASK, "beam_width": 2, "length_penalty": 1e6}, "length_penalty", "46.5"),
    ({"messages": [{"role": 5}]}, "messages[0]", "a string role"),
]


@pytest.mark.parametrize("raw,param,words", BAD)
def test_a_bad_input_is_400_naming_the_parameter(raw, param, words):
    e = refused(raw)
    assert e.param == param and words in e.message, (e.param, e.message)
    if param is not None:
        assert e.message.startswith(param), e.message


def test_a_body_nested_too_deep_is_refused_naming_the_limit():
    deep = '{"prompt": [1], "x": ' + "[" * 100_000 + "]" * 100_000 + "}"
    e = refused(deep)
    assert "more than 64 levels" in e.message
    e = refused('{"prompt": [1], "x": ' + "[" * 70 + "]" * 70 + "}")  # parses, then refused
    assert e.param == "x" and "more than 64 levels deep (in x)" in e.message
    parse('{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"x": '
          + "[" * 60 + "]" * 60 + "}}")  # a known field (an unknown one is refused: test_request_fields)


def test_a_prompt_too_large_is_refused_by_its_size_before_it_is_tokenized():
    tok = FakeTokenizer()
    limit = 16 * INFO.max_model_len
    parse({"prompt": "a" * limit}, tok)
    assert tok.calls == 1
    e = refused({"prompt": "a" * (limit + 1)}, tok)
    assert e.param == "prompt" and f"at most {limit} bytes" in e.message and tok.calls == 1
    e = refused({"messages": [{"role": "user", "content": "é" * (limit // 4)}] * 3}, tok)
    assert e.param == "messages" and "bytes" in e.message and tok.calls == 1
    e = refused({"messages": [{"role": "user", "content": "a" * (limit + 1)}], "tools": [TOOL]}, tok)
    assert e.param == "messages" and tok.calls == 1
    with pytest.raises(OpenAIError) as err:
        tokenize_body({"prompt": "a" * (limit + 1)}, INFO, tok)
    assert err.value.param == "prompt" and tok.calls == 1


def test_types_stay_as_strict_as_before_and_unknown_parameters_are_refused():
    e = refused({"prompt": [1, 2], "whatever": {"a": [1]}})
    assert e.param == "whatever" and "not a parameter this server knows" in e.message
    r = parse({"prompt": [1, 2], "n": 2.0, "max_tokens": 3.0, "temperature": 1, "whatever": None,
               "stop": ["", "x"], "seed": 2 ** 63 - 1, "priority": -2 ** 31, "cache_salt": "s" * 1024})
    s = r.sampling
    assert (s.n, s.max_tokens, s.temperature, s.stop, s.seed) == (2, 3, 1.0, ["x"], 2 ** 63 - 1)
    assert (r.priority, r.cache_salt) == (-2 ** 31, "s" * 1024)
    assert parse({"prompt": [1], "stop": None, "seed": None}).sampling.max_tokens == FIELDS["max_tokens"].default
    chat = parse({"messages": ASK}).sampling
    assert chat.max_tokens == INFO.max_model_len - 2  # the rest of the context after a 2-token prompt
    e = refused({"prompt": [1], "temperature": True})
    assert e.param == "temperature" and "a number" in e.message


def test_tool_messages_reach_the_template_as_dicts():
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]
    r = parse({"messages": ASK + [{"role": "assistant", "content": None, "tool_calls": calls},
                                  {"role": "tool", "content": "42", "tool_call_id": "c1"}], "tools": [TOOL]})
    assert r.prompts[0] and r.tools is not None


def test_detokenize_checks_its_tokens():
    assert detokenize_body({"tokens": [72, 105]}, INFO, FakeTokenizer()) == "Hi"
    for tokens, param in (([-1], "tokens"), (["x"], "tokens[0]"), ([1] * 2049, "tokens")):
        with pytest.raises(OpenAIError) as e:
            detokenize_body({"tokens": tokens}, INFO, FakeTokenizer())
        assert e.value.param == param


def test_the_openapi_document_takes_its_bounds_from_the_field_table():
    doc = openapi_document()
    schemas = doc["components"]["schemas"]
    completion = schemas["CompletionRequest"]["properties"]

    def typed(prop):
        return next(s for s in prop["anyOf"] if s.get("type") != "null")

    assert typed(completion["top_k"])["maximum"] == FIELDS["top_k"].high == 2 ** 31 - 1
    assert typed(completion["top_p"])["exclusiveMinimum"] == 0
    assert typed(completion["stop_token_ids"])["items"]["maximum"] == 2 ** 32 - 1
    assert typed(schemas["ChatRequest"]["properties"]["messages"])["maxItems"] == request_limits.MAX_MESSAGES
    assert set(doc["paths"]) >= {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"}
    ref = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert ref == {"$ref": "#/components/schemas/ChatRequest"}
    assert schemas["CompletionRequest"]["additionalProperties"] is True
