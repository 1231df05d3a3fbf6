"""Fuzzed requests for the public gRPC API (pagedserve.v1.Generation): Generate and Chat
with hostile SamplingParams (every field at the edges of its protobuf type: NaN and
infinite floats, denormals, int32 and uint32 extremes, guided specs that are malformed or
costly), hostile prompts, token ids, roles, models and salts, streams the client cancels
after a few messages, Tokenize with hostile text, and string fields holding invalid UTF-8
(written into the serialized message, which the protobuf library itself would refuse).

Contract: `grpc_probe(rng, prefix, target) -> Probe fields` (pagedserve.benchmarks.fuzz_http's
convention); the body is the serialized request. Accepted requests are small work (at most
8 output tokens; a hostile max_tokens is one the server must refuse).
"""
from __future__ import annotations

import json
import random

from pagedserve.benchmarks import fuzz_values as v
from pagedserve.benchmarks.fuzz_http import TAILS, Target
from pagedserve.wire.v1 import generation_pb2 as pb

SERVICE = "/pagedserve.v1.Generation/"
MARK = "\x7fFUZZ\x7f"  # replaced by as many bytes of invalid UTF-8 once serialized
INVALID_UTF8 = (b"\xed\xa0\x80\xff\xfe\xc0", b"\xc3\x28\xa0\xa1\xf0\x28", b"\xf8\x88\x80\x80\x80\x00")
U32 = (0, 1, 2, 3, 6, 20, 21, 128, 129, 49151, 49152, 2 ** 31, 2 ** 32 - 1)
I32 = (-2 ** 31, -2, -1, 0, 1, 2, 49152, 2 ** 31 - 1)
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag", "bogus", "")


def clean(s: str) -> str:
    """`s` with lone surrogates replaced, as a protobuf string field takes it."""
    return s.encode("utf-8", "replace").decode()


def _guided(rng: random.Random, s: pb.SamplingParams) -> None:
    kind = rng.choice(KINDS) if rng.random() < 0.9 else clean(v.text(rng))
    spec = {"json_schema": lambda: json.dumps(v.schema(rng)), "regex": lambda: v.regex(rng),
            "grammar": lambda: v.grammar(rng), "choice": lambda: json.dumps(v.choices(rng)),
            "structural_tag": lambda: json.dumps(v.wrong_type(rng))}.get(kind, lambda: clean(v.text(rng)))()
    s.guided_kind, s.guided_spec = kind, clean(spec)


def sampling(rng: random.Random, target: Target) -> pb.SamplingParams:
    """Cheap valid parameters with one to four fields made hostile."""
    s = pb.SamplingParams(max_tokens=rng.randint(1, 6), temperature=rng.choice((0.0, 0.7, 1.0)))
    for _ in range(rng.randint(1, 4)):
        name = rng.choice(("max_tokens", "n", "logprobs", "beam_width", "prompt_logprobs", "stop_token_ids",
                           "temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                           "frequency_penalty", "length_penalty", "top_k", "seed", "stop", "ignore_eos",
                           "early_stopping", "guided"))
        if name == "max_tokens":
            s.max_tokens = rng.choice((0, target.max_model_len + 1, 2 ** 32 - 1, rng.randint(1, 8)))
        elif name in ("n", "logprobs", "beam_width", "prompt_logprobs"):
            setattr(s, name, rng.choice(U32))
        elif name == "stop_token_ids":
            s.stop_token_ids.extend(rng.choice(U32) for _ in range(rng.randint(1, 4)))
        elif name == "top_k":
            s.top_k = rng.choice(I32)
        elif name == "seed":
            s.seed = rng.choice((0, 1, 2 ** 63, 2 ** 64 - 1))
        elif name == "stop":
            s.stop.extend(clean(v.text(rng)) for _ in range(rng.randint(1, 3)))
        elif name in ("ignore_eos", "early_stopping"):
            setattr(s, name, True)
        elif name == "guided":
            _guided(rng, s)
        else:
            setattr(s, name, rng.choice(v.FLOATS))
    return s


def _generate(rng: random.Random, prefix: str, target: Target, s: pb.SamplingParams) -> pb.GenerateRequest:
    r = pb.GenerateRequest(prompt=f"{prefix} {rng.choice(TAILS)}", sampling=s)
    roll = rng.random()
    if roll < 0.15:
        r.prompt = clean(v.text(rng))
    elif roll < 0.3:
        r.prompt = ""
        r.prompt_token_ids.extend(rng.choice(U32) if rng.random() < 0.3 else rng.randrange(1000)
                                  for _ in range(rng.choice((0, 1, 8, 5000))))
    return r


def _chat(rng: random.Random, prefix: str, s: pb.SamplingParams) -> pb.ChatRequest:
    messages = [pb.ChatMessage(role="system", content=prefix), pb.ChatMessage(role="user", content=rng.choice(TAILS))]
    if rng.random() < 0.3:
        m = rng.choice(messages)
        setattr(m, rng.choice(("role", "content")), clean(v.text(rng)))
    if rng.random() < 0.1:
        del messages[:]
    if rng.random() < 0.1:
        messages += [pb.ChatMessage(role=rng.choice(("tool", "assistant", "user", "")), content="x")] * 50
    return pb.ChatRequest(messages=messages, sampling=s)


def _set_any_string(rng: random.Random, r) -> None:
    """Puts MARK into one string field of `r` (prompt, a role, a stop string, ...)."""
    if isinstance(r, pb.TokenizeRequest):
        r.text += MARK
    elif isinstance(r, pb.ChatRequest) and r.messages and rng.random() < 0.6:
        m = rng.choice(r.messages)
        setattr(m, rng.choice(("role", "content")), getattr(m, "content") + MARK)
    elif rng.random() < 0.5 and isinstance(r, pb.GenerateRequest):
        r.prompt += MARK
    else:
        rng.choice((lambda: r.sampling.stop.append(MARK), lambda: setattr(r, "cache_salt", MARK),
                    lambda: setattr(r, "model", MARK), lambda: setattr(r.sampling, "guided_spec", MARK)))()


def grpc_probe(rng: random.Random, prefix: str, target: Target) -> dict:
    s = sampling(rng, target)
    roll = rng.random()
    if roll < 0.55:
        method, r = "Generate", _generate(rng, prefix, target, s)
    elif roll < 0.85:
        method, r = "Chat", _chat(rng, prefix, s)
    else:
        method = "Tokenize"
        r = pb.TokenizeRequest(text=clean(v.text(rng)), add_special_tokens=rng.random() < 0.5)
    if method != "Tokenize":
        if rng.random() < 0.1:
            r.priority = rng.choice(I32)
        if rng.random() < 0.1:
            r.cache_salt = clean(v.text(rng))
        if rng.random() < 0.1:
            r.request_id = clean(v.text(rng)) * rng.choice((1, 1000))
    if rng.random() < 0.1:
        r.model = rng.choice(("", "gpt-4", clean(v.text(rng)), target.model + " "))
    invalid = rng.random() < 0.15
    if invalid:
        _set_any_string(rng, r)
    body = r.SerializeToString()
    if invalid:
        body = body.replace(MARK.encode(), rng.choice(INVALID_UTF8))
    leaves = method != "Tokenize" and rng.random() < 0.1
    return dict(api="grpc", target=SERVICE + method, body=body, stream=method != "Tokenize",
                disconnect_after=rng.randint(0, 2) if leaves else None)
