"""Reference requests run beside the fuzzed ones: greedy, a fixed question after a prefix,
each compared with a fresh computation of the same request.

Contract: `check(conns, api, prefix, question, kind, after)` sends the request as is, then
the same request with a new random cache_salt (a namespace no other request shares, so
nothing is served from the prefix cache), and returns a Reference with both texts. Its
`mismatch` is the poisoned-output invariant: both answered 200 / OK and the texts differ.
A request as is that the server fails (another request's failure can end it) is sent once
more, since the blocks it computed may now be cached wrong; every error is kept in
`errors` (`server_error` when one is the server's fault). APIs: "completions" and "chat"
(HTTP), "generate" (gRPC). Greedy (temperature 0) with 8 output tokens.
"""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field

import grpc
import httpx

from pagedserve.benchmarks.fuzz_probe import SERVER_CODES, truncate
from pagedserve.benchmarks.fuzz_send import Connections
from pagedserve.wire.v1 import generation_pb2 as pb

APIS = ("completions", "chat", "generate")
QUESTIONS = ("Then", "Next,", "In short:", "The end of the list is", "Once more:")
MAX_TOKENS = 8


@dataclass
class Reference:
    api: str
    kind: str  # "shared" prefix, "fresh" (after the probe `after` used it first) or "none"
    prompt: str
    after: str | None = None  # "#12 numbers": the probe that used the fresh prefix first
    cached: str | None = None  # the answer to the request as is
    fresh: str | None = None  # the answer with a new cache_salt
    errors: list[str] = field(default_factory=list)
    server_error: bool = False

    @property
    def mismatch(self) -> bool:
        return self.cached is not None and self.fresh is not None and self.cached != self.fresh


class _Failed(Exception):
    def __init__(self, message: str, server_error: bool):
        super().__init__(message)
        self.server_error = server_error


async def _http(conns: Connections, path: str, body: dict) -> dict:
    try:
        r = await conns.http.post(conns.base_url + path, content=json.dumps(body).encode(),
                                  headers={"content-type": "application/json"}, timeout=conns.timeout)
    except httpx.HTTPError as e:
        raise _Failed(f"no answer: {type(e).__name__}", True) from None
    if r.status_code != 200:
        raise _Failed(f"http {r.status_code}: {truncate(r.text, 200)}", r.status_code >= 500)
    return r.json()


async def _answer(conns: Connections, api: str, prefix: str, question: str, salt: str | None) -> str:
    if api == "completions":
        body = {"model": conns.model, "prompt": f"{prefix} {question}", "max_tokens": MAX_TOKENS, "temperature": 0}
        if salt:
            body["cache_salt"] = salt
        return (await _http(conns, "/v1/completions", body))["choices"][0]["text"]
    if api == "chat":
        body = {"model": conns.model, "max_tokens": MAX_TOKENS, "temperature": 0,
                "messages": [{"role": "system", "content": prefix}, {"role": "user", "content": question}]}
        if salt:
            body["cache_salt"] = salt
        return (await _http(conns, "/v1/chat/completions", body))["choices"][0]["message"]["content"]
    request = pb.GenerateRequest(prompt=f"{prefix} {question}", cache_salt=salt or "",
                                 sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    generate = conns.channel.unary_stream("/pagedserve.v1.Generation/Generate",
                                          request_serializer=pb.GenerateRequest.SerializeToString,
                                          response_deserializer=pb.GenerateResponse.FromString)
    try:
        return "".join([r.text async for r in generate(request, timeout=conns.timeout)])
    except grpc.aio.AioRpcError as e:
        code = e.code().name
        raise _Failed(f"grpc {code}: {truncate(e.details() or '', 200)}",
                      code in SERVER_CODES or code == "DEADLINE_EXCEEDED") from None


async def check(conns: Connections, api: str, prefix: str, question: str, kind: str,
                after: str | None = None) -> Reference:
    ref = Reference(api, kind, f"{prefix} {question}", after)
    for attempt in (1, 2):
        try:
            ref.cached = await _answer(conns, api, prefix, question, None)
            break
        except _Failed as e:
            ref.errors.append(f"as is: {e}")
            ref.server_error |= e.server_error
            if not e.server_error:
                return ref
    if ref.cached is None:
        return ref
    try:
        ref.fresh = await _answer(conns, api, prefix, question, secrets.token_hex(8))
    except _Failed as e:
        ref.errors.append(f"fresh: {e}")
        ref.server_error |= e.server_error
    return ref
