"""Run a Gateway on its own uvloop thread for tests, and small gRPC client helpers.
`Serialized` makes an in-process MemoryManager safe to read from the test's thread while
the gateway's loop thread reserves (memsvc's server serializes its calls the same way)."""
from __future__ import annotations

import asyncio
import threading

import grpc
import uvloop

from pagedserve.gateway.server import Backend, Gateway
from pagedserve.wire.v1 import generation_pb2 as pb
from pagedserve.wire.v1 import generation_pb2_grpc as pb_grpc


class GatewayThread:
    def __init__(self, connect, scheduler=None, **options):
        """`options` go to the Gateway (reasoning_parser, served_model_name, ...)."""
        self.loop = uvloop.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.gateway = Gateway(connect, scheduler, port=0, retry_seconds=0.1, **options)
        self.port = self._call(self.gateway.start())
        self.address = f"127.0.0.1:{self.port}"
        self.channel = grpc.insecure_channel(self.address)
        self.stub = pb_grpc.GenerationStub(self.channel)

    def _call(self, coro, timeout=30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def wait_ready(self, timeout=60):
        self._call(asyncio.wait_for(self.gateway.ready.wait(), timeout), timeout + 1)

    @property
    def runner(self):
        return self.gateway.service.runner

    def close(self):
        self.channel.close()
        self._call(self.gateway.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class Serialized:
    """`target` with every method call under one lock."""

    def __init__(self, target):
        self._target, self._lock = target, threading.Lock()

    def __getattr__(self, name):
        attr = getattr(self._target, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            with self._lock:
                return attr(*args, **kwargs)
        return call


def in_process(memory, executor, tokenizer=None):
    return lambda: Backend(memory, executor, tokenizer)


def collect(stream) -> dict[int, dict]:
    """Drain a GenerateResponse stream into {index: {text, token_ids, finish_reason, usage}}."""
    out: dict[int, dict] = {}
    for r in stream:
        c = out.setdefault(r.index, {"text": "", "token_ids": [], "finish_reason": None})
        c["text"] += r.text
        c["token_ids"] += list(r.token_ids)
        c["usage"] = (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.cached_tokens)
        c["request_id"] = r.request_id
        if r.finish_reason:
            c["finish_reason"] = r.finish_reason
    return out


def greedy(max_tokens, **kw) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)
