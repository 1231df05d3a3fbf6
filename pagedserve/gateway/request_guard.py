"""Requests that are not valid protobuf get INVALID_ARGUMENT, not UNKNOWN.

grpc.aio answers a request its deserializer cannot parse with UNKNOWN ("Unexpected
DecodeError"). This interceptor decodes unary requests itself: a message that does not
parse reaches no handler and ends with INVALID_ARGUMENT naming the message type.
"""
from __future__ import annotations

import inspect

import grpc


class _Undecodable:
    def __init__(self, error: Exception):
        self.error = error


def _safe(decode):
    def parse(data: bytes):
        try:
            return decode(data)
        except Exception as e:  # DecodeError and friends: any parse failure
            return _Undecodable(e)

    return parse


async def _refuse(request: _Undecodable, context, method: str) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                        f"the request to {method} is not a valid protobuf message: {request.error}")


class DecodeGuard(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        method = details.method
        kw = dict(request_deserializer=_safe(handler.request_deserializer),
                  response_serializer=handler.response_serializer)
        if handler.response_streaming:
            inner = handler.unary_stream

            async def stream(request, context):
                if isinstance(request, _Undecodable):
                    await _refuse(request, context, method)
                result = inner(request, context)
                if inspect.isasyncgen(result):
                    async for r in result:
                        yield r
                else:
                    for r in await result if inspect.isawaitable(result) else result:
                        yield r

            return grpc.unary_stream_rpc_method_handler(stream, **kw)
        inner = handler.unary_unary

        async def unary(request, context):
            if isinstance(request, _Undecodable):
                await _refuse(request, context, method)
            result = inner(request, context)
            return await result if inspect.isawaitable(result) else result

        return grpc.unary_unary_rpc_method_handler(unary, **kw)
