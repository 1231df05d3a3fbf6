"""Fuzzed OpenAI HTTP requests that are mostly valid with a few fields made hostile:
out-of-range numbers, wrong types, unicode edge cases, beam search and n > 1 at their
limits, clients that leave mid-stream. pagedserve.benchmarks.fuzz_http_shapes has the rest (huge and
nested bodies, schemas, tools, /tokenize, raw bytes).

Contract: each generator is `gen(rng, prefix, target) -> Probe fields` (a dict of Probe
keyword arguments without index and category). A request that the server accepts is small
work: at most 8 output tokens (48 for the ones the client leaves), at most 128 sequences;
a max_tokens the generator makes hostile is one the server must refuse (over the model's
length, zero, negative, not an integer), never a long generation.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass

from pagedserve.benchmarks import fuzz_values as v

TAILS = ("Then", "Tell me more.", "Continue the list:", "Summarize it in one word.", "Translate: bonjour",
         "What comes next?", "1, 2, 3,")
NUMERIC = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
           "frequency_penalty", "seed", "n", "logprobs", "best_of", "priority", "beam_width", "length_penalty",
           "stop_token_ids", "prompt_logprobs", "top_logprobs", "max_completion_tokens")
OTHER_FIELDS = ("prompt", "messages", "model", "stream", "stop", "stream_options", "echo", "ignore_eos",
                "user", "cache_salt", "response_format", "tools", "tool_choice", "logit_bias", "suffix",
                "early_stopping", "parallel_tool_calls", "guided_json", "guided_choice", "n", "logprobs",
                "unknown_field")


@dataclass
class Target:
    """What the generators need to know of the server: the model's name and maximum length."""
    model: str
    max_model_len: int


def encode(rng: random.Random, body) -> bytes:
    """The JSON text of `body`: escaped ASCII (lone surrogates as \\ud800), or now and then
    raw UTF-8 with surrogates passed through (invalid UTF-8 on the wire)."""
    if rng.random() < 0.05:
        return json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")
    return json.dumps(body).encode()


def with_raw_field(body: dict, name: str, raw: str) -> bytes:
    """`body` as JSON with field `name` holding the JSON text `raw` verbatim."""
    head = json.dumps(body)[:-1]
    return f"{head}{', ' if body else ''}{json.dumps(name)}: {raw}}}".encode()


def cheap_max_tokens(value, target: Target):
    """`value` unless it is a max_tokens the server would accept for a long generation."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 8 < value <= target.max_model_len:
        return target.max_model_len + 1
    return value


def completion(rng: random.Random, prefix: str, target: Target) -> dict:
    body = {"model": target.model, "prompt": f"{prefix} {rng.choice(TAILS)}", "max_tokens": rng.randint(1, 6),
            "temperature": rng.choice((0, 0.7, 1.0))}
    if rng.random() < 0.2:
        del body["model"]
    return body


def chat(rng: random.Random, prefix: str, target: Target) -> dict:
    return {"model": target.model, "max_tokens": rng.randint(1, 6), "temperature": rng.choice((0, 0.7, 1.0)),
            "messages": [{"role": "system", "content": prefix}, {"role": "user", "content": rng.choice(TAILS)}]}


def base(rng: random.Random, prefix: str, target: Target) -> tuple[str, dict]:
    """(path, body) of a valid completion (60%) or chat request, streamed 30% of the time."""
    if rng.random() < 0.6:
        path, body = "/v1/completions", completion(rng, prefix, target)
    else:
        path, body = "/v1/chat/completions", chat(rng, prefix, target)
    if rng.random() < 0.3:
        body["stream"] = True
    return path, body


def http_fields(rng, path: str, body: dict, raw: bytes | None = None, **extra) -> dict:
    return dict(api="http", target=path, body=raw if raw is not None else encode(rng, body),
                stream=body.get("stream") is True, **extra)


def numbers(rng: random.Random, prefix: str, target: Target) -> dict:
    """One to three numeric fields at or past the edge of their range."""
    path, body = base(rng, prefix, target)
    for name in rng.sample(NUMERIC, rng.randint(1, 3)):
        if name == "stop_token_ids":
            body[name] = [v.number(rng) if rng.random() < 0.7 else rng.randint(0, 50000)
                          for _ in range(rng.randint(1, 4))]
        elif name in ("max_tokens", "max_completion_tokens"):
            body[name] = cheap_max_tokens(v.number(rng), target)
        else:
            body[name] = v.number(rng)
    if rng.random() < 0.3:  # beside a valid feature, whose path may meet the hostile value
        feature = rng.choice(("logprobs", "n", "seed", "stop", "ignore_eos"))
        if feature == "logprobs" and not {"logprobs", "top_logprobs"} & set(body):
            body.update({"logprobs": True, "top_logprobs": 2} if "messages" in body else {"logprobs": 2})
        elif feature != "logprobs":
            body.setdefault(feature, {"n": 2, "seed": 7, "stop": ["."], "ignore_eos": True}[feature])
    return http_fields(rng, path, body)


def types(rng: random.Random, prefix: str, target: Target) -> dict:
    """One to three fields (or a message's role or content) replaced by a wrong-typed value."""
    path, body = base(rng, prefix, target)
    for _ in range(rng.randint(1, 3)):
        messages = body.get("messages")
        if isinstance(messages, list) and messages and rng.random() < 0.3:
            m = rng.choice(messages)
            if isinstance(m, dict):  # (an earlier round may have replaced it)
                m[rng.choice(("role", "content", "name", "tool_calls"))] = v.wrong_type(rng)
            continue
        name = rng.choice(NUMERIC + OTHER_FIELDS)
        body[name] = v.wrong_type(rng)
        if name in ("max_tokens", "max_completion_tokens"):
            body[name] = cheap_max_tokens(body[name], target)
    if "messages" in body and rng.random() < 0.1:
        body["messages"] = v.wrong_type(rng)
    return http_fields(rng, path, body)


def unicode(rng: random.Random, prefix: str, target: Target) -> dict:
    """Unicode edge cases (lone surrogates, NUL, combining runs, special-token text) in one
    to three of the prompt, stop strings, messages, user, cache_salt, model or a key."""
    path, body = base(rng, prefix, target)
    for _ in range(rng.randint(1, 3)):
        where = rng.choice(("prompt", "prompt", "stop", "stop", "user", "cache_salt", "model", "key", "whole"))
        s = v.text(rng)
        if where == "prompt":
            if "messages" in body:
                rng.choice(body["messages"])[rng.choice(("content", "content", "role", "name"))] = s
            elif rng.random() < 0.2:
                body["prompt"] = [body["prompt"], s]
            else:
                body["prompt"] += " " + s
        elif where == "stop":
            body["stop"] = s if rng.random() < 0.5 else [s, v.text(rng)]
        elif where == "key":
            body[s] = v.wrong_type(rng)
        elif where == "whole":  # no shared prefix: the prompt is only the hostile text
            if "messages" in body:
                body["messages"] = [{"role": "user", "content": s}]
            else:
                body["prompt"] = s
        else:
            body[where] = s
    return http_fields(rng, path, body)


def beam_n(rng: random.Random, prefix: str, target: Target) -> dict:
    """Beam search and n > 1 at and past their limits, with extreme length penalties."""
    path, body = base(rng, prefix, target)
    body["max_tokens"] = rng.randint(1, 8)
    if rng.random() < 0.8:
        body["beam_width"] = rng.choice((2, 2, 3, 4, 10, 11, 0, 1, -1, 2 ** 31, 1.5))
    if rng.random() < 0.7:
        body["length_penalty"] = rng.choice((1000, -1000, 1e308, -1e308, 0, 1e-300, 1.0, 2.0, -2.0, 1e39,
                                             float("nan"), float("inf"), 10 ** 400))
    if rng.random() < 0.4:
        body["early_stopping"] = rng.choice((True, False, "never", 1))
    if rng.random() < 0.6:
        body["n"] = rng.choice((1, 2, 3, 4, 10, 128, 129, body.get("beam_width", 2)))
    if rng.random() < 0.3:
        body["logprobs" if "prompt" in body else "top_logprobs"] = rng.choice((0, 5, 20, 21))
        if "messages" in body:
            body["logprobs"] = True
    if rng.random() < 0.3:
        body["stop"] = [v.text(rng) if rng.random() < 0.3 else rng.choice(("the", ".", " "))]
    if rng.random() < 0.3:
        body["ignore_eos"] = True
    if rng.random() < 0.3:
        body["temperature"] = rng.choice((0, 1.0, 1e-6))
        body["seed"] = rng.randrange(2 ** 32)
    return http_fields(rng, path, body)


def disconnect(rng: random.Random, prefix: str, target: Target) -> dict:
    """A valid request whose client leaves: a stream closed after 0 to 3 chunks, or a
    whole answer given up after 50 to 500 ms."""
    path, body = base(rng, prefix, target)
    body.update(max_tokens=rng.randint(16, 48), ignore_eos=True)
    if rng.random() < 0.3:
        body["n"] = rng.randint(2, 4)
    elif rng.random() < 0.2:
        body.update(beam_width=rng.randint(2, 4), temperature=0)
    if rng.random() < 0.6:
        body["stream"] = True
        return http_fields(rng, path, body, disconnect_after=rng.randint(0, 3))
    body.pop("stream", None)
    return http_fields(rng, path, body, client_timeout=rng.uniform(0.05, 0.5))
