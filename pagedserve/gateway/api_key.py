"""An optional API key on the public gRPC API.

With a key configured, every call except grpc.health.v1 (probes carry no secrets) must
send metadata `authorization: Bearer <key>` or `x-api-key: <key>`; any other call ends
with UNAUTHENTICATED before it reaches the service. Keys are compared in constant time.
"""
from __future__ import annotations

import hmac

import grpc

OPEN_PREFIXES = ("/grpc.health.v1.Health/",)
MESSAGE = "missing or wrong API key: send metadata 'authorization: Bearer <key>'"


def presented_key(metadata) -> str | None:
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str) and value[:7].lower() == "bearer ":
            return value[7:].strip()
        if key == "x-api-key" and isinstance(value, str):
            return value.strip()
    return None


def key_matches(expected: str, metadata) -> bool:
    got = presented_key(metadata)
    return got is not None and hmac.compare_digest(got.encode(), expected.encode())


async def _deny_unary(request, context):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, MESSAGE)


async def _deny_stream(request, context):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, MESSAGE)
    yield  # pragma: no cover (makes this an async generator)


async def _deny_stream_in(request_iterator, context):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, MESSAGE)


async def _deny_stream_stream(request_iterator, context):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, MESSAGE)
    yield  # pragma: no cover


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, api_key: str):
        if not api_key:
            raise ValueError("the API key is empty")
        self.api_key = api_key

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if (handler is None or details.method.startswith(OPEN_PREFIXES)
                or key_matches(self.api_key, details.invocation_metadata)):
            return handler
        kw = dict(request_deserializer=handler.request_deserializer,
                  response_serializer=handler.response_serializer)
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(_deny_stream_stream, **kw)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(_deny_stream_in, **kw)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(_deny_stream, **kw)
        return grpc.unary_unary_rpc_method_handler(_deny_unary, **kw)
