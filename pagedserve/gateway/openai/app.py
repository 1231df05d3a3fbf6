"""The OpenAI-compatible HTTP API as a Starlette app over a running gRPC Gateway.

Routes: POST /v1/completions, POST /v1/chat/completions (streaming or not), GET /v1/models,
GET /v1/models/{model}, POST /tokenize, POST /detokenize, GET /health (200 once the backend
answers, 503 before and while it recovers), GET /metrics (Prometheus: the gateway's and its
upstreams', pagedserve.gateway.metrics_proxy; no API key, like /health), GET /openapi.json (the request
bodies' schemas, pagedserve.gateway.openai.openapi; no API key). The app shares the Gateway's
StepRunner, so HTTP and gRPC requests are batched together.

Contract:
- The model's every name (--served-model-name, pagedserve.wire.served_names) is listed by
  /v1/models and served; responses report the first; another model is a 404 naming them.
- With an API key set, every /v1 route needs `Authorization: Bearer <key>` (else 401).
- Errors are OpenAI's {"error": {...}} with 400 (the bad parameter in `param`), 401, 404
  (unknown model or path), 503 (starting, or the backend failed). A streamed response
  decides its status on the request's first output, so a request the KV pool can never
  hold is a 400 there too; a backend failure after that ends the stream with an error
  event and `data: [DONE]`.
- 429 when the gateway's waiting queue is full (`--max-waiting`); without a bound,
  requests wait for KV blocks. 429 and 503 carry Retry-After.
- 413 for a body over `max_body_bytes` (`--max-request-bytes`, as the gRPC API's limit),
  told by Content-Length or counted while reading.
- A body is read (JSON, every parameter checked, the prompt tokenized, a grammar prepared:
  pagedserve.gateway.openai.json_body, pagedserve.gateway.openai.request) on the gateway's parse pool
  (pagedserve.gateway.parse_pool), not on the event loop that serves every client; a bad one is a 400
  naming the parameter before anything is queued.
- A client that disconnects, streaming or not, has its sequences aborted before the
  next step; their blocks are freed by the next reserve.

Packages: starlette and pydantic (and httpx, for /metrics' upstreams) are needed only here;
the gateway imports this module only when --http-port asks for the HTTP API, and importing
it without them raises pagedserve.wire.optional_import.MissingPackage naming the package and
--http-port 0.
"""
from __future__ import annotations

import asyncio
import secrets
import time

from pagedserve.wire.optional_import import require

HTTP_FEATURE = "the OpenAI-compatible HTTP API (--http-port)"
HTTP_OFF = "--http-port 0 to turn it off"
for _module in ("starlette", "httpx", "pydantic"):  # named before the imports below fail unnamed
    require(_module, _module, HTTP_FEATURE, off=HTTP_OFF)

from starlette.applications import Starlette  # noqa: E402
from starlette.exceptions import HTTPException  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import JSONResponse, Response, StreamingResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402

from pagedserve.gateway.metrics_proxy import CONTENT_TYPE, ReplicaMetrics
from pagedserve.gateway.openai import json_body
from pagedserve.gateway.openai.errors import OpenAIError, from_stream_error, model_not_found, unavailable
from pagedserve.gateway.openai.openapi import openapi_document
from pagedserve.gateway.openai.request import (OpenAIRequest, detokenize_body, parse_chat, parse_completion,
                                    tokenize_body)
from pagedserve.gateway.openai.response import DONE, Formatter, sse
from pagedserve.gateway.reasoning import parser_for
from pagedserve.gateway.request_stream import RequestStream, StreamError
from pagedserve.wire.served_names import names_of, serves

CLIENT_CLOSED = 499
MAX_BODY_BYTES = 4 << 20


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body; OpenAIError 413 past `limit` bytes."""
    too_large = OpenAIError(413, f"the request body exceeds {limit} bytes (--max-request-bytes)",
                            code="request_too_large")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def _parsed(parse, raw: bytes, info, tokenizer):
    """`parse` of the JSON body `raw` (on the parse pool)."""
    return parse(json_body.loads(raw), info, tokenizer)


def error_response(e: OpenAIError) -> JSONResponse:
    headers = {401: {"WWW-Authenticate": "Bearer"}, 429: {"Retry-After": "1"},
               503: {"Retry-After": "1"}}.get(e.status)
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


class _Stream(StreamingResponse):
    """A StreamingResponse that calls `on_close` however it ends (done, error, disconnect)."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


async def _unless_disconnected(request: Request, coro):
    """`coro`'s result, or None if the client disconnects first (`coro` is then cancelled)."""
    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work, watch = asyncio.ensure_future(coro), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, watch):
            if not task.done():
                task.cancel()
    return work.result() if work.done() and not work.cancelled() else None


class OpenAIApi:
    def __init__(self, gateway, api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES,
                 metrics_upstreams: list[tuple[str, str]] | None = None):
        self.gateway = gateway
        self.api_key = api_key or None
        self.max_body_bytes = max_body_bytes
        self.metrics = ReplicaMetrics(gateway.service.metrics.registry, metrics_upstreams,
                                      model_name=lambda: gateway.service.metrics.model_name)
        self.created = int(time.time())

    def app(self) -> Starlette:
        routes = [
            Route("/health", self.health),
            Route("/metrics", self.prometheus),
            Route("/v1/models", self.models),
            Route("/v1/models/{model:path}", self.model),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/openapi.json", self.openapi),
        ]
        return Starlette(routes=routes, exception_handlers={HTTPException: _http_error})

    async def health(self, request: Request) -> Response:
        if self.gateway.serving:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable"}, status_code=503)

    async def openapi(self, request: Request) -> Response:
        return JSONResponse(openapi_document())

    async def prometheus(self, request: Request) -> Response:
        return Response(await self.metrics.render(), media_type=CONTENT_TYPE)

    async def models(self, request: Request) -> Response:
        try:
            self._authorize(request)
            info = self._service().info
            return JSONResponse({"object": "list", "data": [self._card(info, n) for n in names_of(info)]})
        except OpenAIError as e:
            return error_response(e)

    async def model(self, request: Request) -> Response:
        try:
            self._authorize(request)
            info, model = self._service().info, request.path_params["model"]
            if not serves(info, model):
                raise model_not_found(model, names_of(info))
            return JSONResponse(self._card(info, model))
        except OpenAIError as e:
            return error_response(e)

    async def tokenize(self, request: Request) -> Response:
        """{prompt} or {messages}: the token ids the completions or chat API would use
        ({"count", "max_model_len", "tokens"}); `add_special_tokens` (prompt only, default
        false as in completions), `add_generation_prompt` (messages, default true)."""
        try:
            self._authorize(request)
            service = self._service()
            raw = await read_body(request, self.max_body_bytes)
            tokens = await service.parse_pool.run(_parsed, tokenize_body, raw, service.info,
                                                  service.backend.tokenizer)
            return JSONResponse({"count": len(tokens), "max_model_len": service.info.max_model_len,
                                 "tokens": tokens})
        except OpenAIError as e:
            return error_response(e)

    async def detokenize(self, request: Request) -> Response:
        """{tokens: [ids]} -> {"prompt": text}."""
        try:
            self._authorize(request)
            service = self._service()
            raw = await read_body(request, self.max_body_bytes)
            text = await service.parse_pool.run(_parsed, detokenize_body, raw, service.info,
                                                service.backend.tokenizer)
            return JSONResponse({"prompt": text})
        except OpenAIError as e:
            return error_response(e)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, parse_completion)

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, parse_chat)

    async def _generate(self, request: Request, parse) -> Response:
        stream = None
        try:
            self._authorize(request)
            service = self._service()
            raw = await read_body(request, self.max_body_bytes)
            req = await service.parse_pool.run(_parsed, parse, raw, service.info, service.backend.tokenizer)
            self._service()  # a drain may have begun while it was read
            req.reasoning = parser_for(service.reasoning_parser, req.chat, req.sampling)
            stream = RequestStream(service.runner, req.prompts, req.sampling,
                                   operation="chat" if req.chat else "text_completion",
                                   model=service.info.name, telemetry=service.telemetry,
                                   metadata=list(request.headers.items()), priority=req.priority,
                                   salt=req.cache_salt, public_id=req.request_id)
            await _http_errors(req, stream.start())
            fmt = Formatter(req, service.backend.tokenizer,
                            id=req.request_id and ("chatcmpl-" if req.chat else "cmpl-") + req.request_id)
            first = await _unless_disconnected(request, _http_errors(req, stream.next_batch()))
            if first is None:
                return Response(status_code=CLIENT_CLOSED)
            if req.stream:
                response, stream = _Stream(self._events(stream, fmt, first), stream.abort), None
                return response
            if await _unless_disconnected(request, self._collect(stream, fmt, first)) is None:
                return Response(status_code=CLIENT_CLOSED)
            return JSONResponse(fmt.body())
        except OpenAIError as e:
            return error_response(e)
        finally:
            if stream is not None:
                stream.abort()

    async def _collect(self, stream: RequestStream, fmt: Formatter, first) -> bool:
        for i, d in first:
            fmt.add(i, d)
        while stream.open:
            for i, d in await _http_errors(fmt.request, stream.next_batch()):
                fmt.add(i, d)
        return True

    async def _events(self, stream: RequestStream, fmt: Formatter, first):
        batch = first
        try:
            while True:
                for i, d in batch:
                    fmt.add(i, d)
                    for event in fmt.chunks(i, d):
                        yield event
                if not stream.open:
                    break
                batch = await _http_errors(fmt.request, stream.next_batch())
        except OpenAIError as e:
            yield sse(e.body())
        else:
            if fmt.request.include_usage:
                yield fmt.usage_chunk()
        yield DONE

    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(),
                                                                    self.api_key.encode()):
            raise OpenAIError(401, "Missing or incorrect API key: send 'Authorization: Bearer <key>'.",
                              code="invalid_api_key")

    def _service(self):
        service = self.gateway.service
        if getattr(service, "draining", False):
            raise unavailable("the gateway is shutting down: retry on another replica")
        if service.runner is None:
            raise unavailable("the gateway is starting: waiting for the executor and memsvc")
        return service

    def _card(self, info, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "pagedserve",
                "max_model_len": info.max_model_len}


async def _http_errors(req: OpenAIRequest, coro):
    """`coro`'s result, its StreamError as the HTTP API's OpenAIError."""
    try:
        return await coro
    except StreamError as e:
        raise from_stream_error(e, "messages" if req.chat else "prompt", len(req.prompts)) from None


async def _http_error(request: Request, exc: HTTPException) -> Response:
    message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on "
               f"{request.url.path}"}.get(exc.status_code, str(exc.detail))
    return error_response(OpenAIError(exc.status_code, message, code=str(exc.status_code)))


def build_app(gateway, api_key: str | None = None, **options) -> Starlette:
    """`options`: max_body_bytes, metrics_upstreams (OpenAIApi)."""
    return OpenAIApi(gateway, api_key, **options).app()

