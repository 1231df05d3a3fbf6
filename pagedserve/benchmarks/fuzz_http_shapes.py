"""Fuzzed OpenAI HTTP requests of hostile shape: huge and deeply nested bodies, hostile
JSON schemas, regexes, grammars and choices, adversarial tool definitions and tool
messages, /tokenize and /detokenize, and bytes that are not a JSON object at all.

Contract: as pagedserve.benchmarks.fuzz_http (`gen(rng, prefix, target) -> Probe fields`); accepted
requests are small work (at most 6 output tokens); the largest body is 5 MiB (over the
gateway's 4 MiB limit on purpose).
"""
from __future__ import annotations

import json
import random

from pagedserve.benchmarks import fuzz_values as v
from pagedserve.benchmarks.fuzz_http import Target, http_fields, base, chat, completion, encode, with_raw_field

MIB = 1 << 20


def huge(rng: random.Random, prefix: str, target: Target) -> dict:
    """Deep nesting, long prompts, many stop strings or messages, many keys, over-limit bodies."""
    path, body = base(rng, prefix, target)
    kind = rng.choice(("nested field", "nested body", "nested prompt", "long prompt", "token list",
                       "many stops", "many messages", "many keys", "over limit", "long field"))
    if kind == "nested field":
        return http_fields(rng, path, body, with_raw_field(body, rng.choice(("x", "stop", "n", "response_format",
                                                                         "tools", "logit_bias")), v.nested_json(rng)))
    if kind == "nested body":
        return http_fields(rng, path, body, v.nested_json(rng).encode())
    if kind == "nested prompt":
        field = "messages" if "messages" in body else "prompt"
        return http_fields(rng, path, body, with_raw_field({k: x for k, x in body.items() if k != field}, field,
                                                      v.nested_json(rng)))
    if kind == "long prompt":
        text = f"{prefix} " + "lorem ipsum dolor sit amet " * rng.choice((100, 1000, 40000))
        if "messages" in body:
            body["messages"][-1]["content"] = text
        else:
            body["prompt"] = text
    elif kind == "token list":
        body = {k: x for k, x in body.items() if k != "messages"}
        path = "/v1/completions"
        body["prompt"] = [rng.randrange(1000) for _ in range(rng.choice((5000, 100000)))]
    elif kind == "many stops":
        body["stop"] = [v.text(rng) if rng.random() < 0.1 else f"s{i}" for i in range(rng.choice((5, 2000)))]
    elif kind == "many messages":
        path, body = "/v1/chat/completions", chat(rng, prefix, target)
        body["messages"] += [{"role": rng.choice(("user", "assistant")), "content": "hi"}
                             for _ in range(rng.choice((500, 20000)))]
    elif kind == "many keys":
        body.update({f"k{i}": i for i in range(100000)})
    elif kind == "over limit":
        body["prompt" if "prompt" in body else "user"] = "a" * (5 * MIB)
    else:
        body["user"] = "u" * rng.choice((MIB, 3 * MIB))
    return http_fields(rng, path, body)


def structured(rng: random.Random, prefix: str, target: Target) -> dict:
    """guided_json / _regex / _grammar / _choice and response_format with hostile specs."""
    path, body = base(rng, prefix, target)
    for _ in range(1 if rng.random() < 0.85 else 2):  # two at once must be refused
        kind = rng.choice(("guided_json", "guided_json", "guided_regex", "guided_grammar", "guided_choice",
                           "response_format"))
        if kind == "guided_json":
            body[kind] = v.schema(rng)
        elif kind == "guided_regex":
            body[kind] = v.regex(rng)
        elif kind == "guided_grammar":
            body[kind] = v.grammar(rng)
        elif kind == "guided_choice":
            body[kind] = v.choices(rng)
        else:
            body[kind] = rng.choice((
                {"type": "json_schema", "json_schema": {"name": v.text(rng), "schema": v.schema(rng),
                                                        "strict": rng.choice((True, False, "yes"))}},
                {"type": "json_object"}, {"type": "json_schema"}, {"type": "xml"}, v.wrong_type(rng),
                {"type": "json_schema", "json_schema": {"name": 5, "schema": {}}}))
    return http_fields(rng, path, body)


def _tool(rng: random.Random, name: str) -> dict:
    fn = {"name": name, "description": v.text(rng) if rng.random() < 0.2 else "a tool"}
    if rng.random() < 0.7:
        fn["parameters"] = v.schema(rng) if rng.random() < 0.4 else {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    return {"type": "function", "function": fn}


def _tool_call(rng: random.Random, name: str):
    args = rng.choice(('{"city": "Paris"}', "not json", {"city": "Paris"}, 5, None, "\ud800", "{" * 1000,
                       json.dumps({"city": v.text(rng)})))
    return rng.choice((
        {"id": "call_1", "type": "function", "function": {"name": name, "arguments": args}},
        {"id": v.wrong_type(rng), "type": "function", "function": {"name": v.wrong_type(rng), "arguments": args}},
        {"type": "function", "function": args}, {"function": {"name": name}}, 1, "call", None, [], [{}]))


def tools(rng: random.Random, prefix: str, target: Target) -> dict:
    """Tool definitions, tool_choice and assistant tool_calls / tool messages, made adversarial."""
    body = chat(rng, prefix, target)
    name = v.text(rng) if rng.random() < 0.2 else "get_weather"
    roll = rng.random()
    if roll < 0.1:
        body["tools"] = v.wrong_type(rng)
    elif roll < 0.2:
        body["tools"] = [_tool(rng, f"f{i}") for i in range(rng.choice((50, 1000)))]
    else:
        body["tools"] = [_tool(rng, name)] + ([_tool(rng, name)] if rng.random() < 0.1 else [])
    if rng.random() < 0.6:
        body["tool_choice"] = rng.choice(("auto", "none", "required", {"type": "function", "function": {"name": name}},
                                          {"type": "function", "function": {"name": "missing"}}, v.wrong_type(rng)))
    if rng.random() < 0.2:
        body["parallel_tool_calls"] = rng.choice((True, False, v.wrong_type(rng)))
    if rng.random() < 0.7:
        calls = [_tool_call(rng, name) for _ in range(rng.randint(1, 3))]
        assistant = {"role": "assistant", "content": rng.choice((None, "", v.text(rng))),
                     "tool_calls": calls if rng.random() < 0.85 else v.wrong_type(rng)}
        result = {"role": "tool", "content": rng.choice(("18 C", v.text(rng), v.wrong_type(rng))),
                  "tool_call_id": rng.choice(("call_1", v.wrong_type(rng), None)), "name": name}
        body["messages"] += rng.choice(([assistant, result], [result], [assistant], [result, assistant, result]))
    if rng.random() < 0.2:
        body["stream"] = True
    return http_fields(rng, "/v1/chat/completions", body)


def tokenize(rng: random.Random, prefix: str, target: Target) -> dict:
    """/tokenize with hostile prompts or messages, /detokenize with hostile token lists."""
    if rng.random() < 0.5:
        body = rng.choice(({"prompt": f"{prefix} {v.text(rng)}"}, {"prompt": v.wrong_type(rng)},
                           {"messages": [{"role": "user", "content": v.text(rng)}]},
                           {"messages": v.wrong_type(rng)}, {"prompt": "x", "add_special_tokens": v.wrong_type(rng)},
                           {"messages": [{"role": v.text(rng), "content": "hi"}], "add_generation_prompt": False},
                           {"prompt": v.text(rng), "model": v.text(rng)}))
        return http_fields(rng, "/tokenize", body)
    tokens = rng.choice(([v.number(rng) for _ in range(rng.randint(1, 4))], [rng.randrange(50000)],
                         [rng.randrange(1000) for _ in range(100000)], v.wrong_type(rng), [True], ["1"], []))
    return http_fields(rng, "/detokenize", {"tokens": tokens})


RAW_BODIES = (b"", b"{", b"null", b"[]", b"1", b'"x"', b"\xff\xfe{}", b'{"prompt": "\xff\xfe\xed\xa0\x80"}',
              b'\xef\xbb\xbf{"prompt": "hi", "max_tokens": 1}', b'{"prompt": "a", "prompt": 5}',
              b'{"prompt": "hi"} trailing', b'{"prompt": "hi", "max_tokens": 1e999}', b"\x00" * 100,
              b'{"max_tokens": -Infinity, "prompt": "x"}', b'{"prompt": "\\ud800\\udc00\\udc00", "max_tokens": 1}')


def raw(rng: random.Random, prefix: str, target: Target) -> dict:
    """Bytes that are not a JSON object, odd content types, wrong methods and paths."""
    path = rng.choice(("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"))
    roll = rng.random()
    if roll < 0.5:
        body = rng.choice(RAW_BODIES) if rng.random() < 0.7 else rng.randbytes(rng.choice((1, 64, 4096)))
        return dict(api="http", target=path, body=body,
                    content_type=rng.choice(("application/json", "text/plain", "", "multipart/form-data")))
    if roll < 0.75:
        return dict(api="http", target=path, method=rng.choice(("GET", "PUT", "DELETE", "PATCH")),
                    body=encode(rng, completion(rng, prefix, target)))
    odd = rng.choice(("/v1/embeddings", "/v1/completions/", "/v1//completions", "/%ff%fe", "/v1/models/%00",
                      "/v1/models/" + "a" * 10000, "/v1/models/..%2f..%2fetc", "/metrics?x=" + "y" * 5000))
    return dict(api="http", target=odd, method=rng.choice(("GET", "POST")),
                body=encode(rng, completion(rng, prefix, target)))
