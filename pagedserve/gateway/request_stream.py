"""One public request on the gateway's step runner, as a stream of (choice, Delta): the part
the gRPC API (pagedserve.gateway.server) and the HTTP API (pagedserve.gateway.openai.app) share.

Contract:
- `start()` submits every prompt (one batching-loop request each, n completions each) and
  opens a telemetry record per prompt; a prompt the loop refuses raises StreamError
  `invalid` (`prompt` says which), a full waiting queue `queue_full`; either aborts the
  prompts already queued.
- `next_batch()` gives one step's deltas of this request as (choice, delta), choice =
  prompt index * n + completion index; empty once every choice has its finish_reason
  (`open` counts those left). A request the KV pool can never hold raises StreamError
  `too_large`, a failed backend step `backend`; both abort what is left.
- `abort(code)` stops whatever has not finished and ends its telemetry with `code`; safe
  any time and more than once. Callers call it when the client goes away, so the
  sequences are freed by the next step's Reserve.
- Each API only maps StreamError to its own status (`code` is the gRPC one) and formats
  the deltas. See docs/ARCHITECTURE.md, "The three services" (the gateway).
"""
from __future__ import annotations

import asyncio
import uuid
from typing import AsyncIterator

import grpc

from pagedserve.gateway.request_intake import RequestError
from pagedserve.gateway.step_runner import QueueFull
from pagedserve.wire.protocol import Delta, SamplingParams

CODES = {"invalid": grpc.StatusCode.INVALID_ARGUMENT, "queue_full": grpc.StatusCode.RESOURCE_EXHAUSTED,
         "too_large": grpc.StatusCode.RESOURCE_EXHAUSTED, "backend": grpc.StatusCode.UNAVAILABLE}
TOO_LARGE = "the KV pool cannot hold this request"


class StreamError(Exception):
    """Why a request ended early: `kind` (a key of CODES), a message, the prompt it is about."""

    def __init__(self, kind: str, message: str, prompt: int | None = None):
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.prompt = prompt

    @property
    def code(self) -> grpc.StatusCode:
        return CODES[self.kind]


class RequestStream:
    def __init__(self, runner, prompts: list[list[int]], sampling: SamplingParams, *,
                 operation: str, model: str, telemetry=None, metadata=None, priority: int = 0,
                 salt: str | None = None, public_id: str = ""):
        self.runner = runner  # pagedserve.gateway.step_runner.StepRunner or pagedserve.gateway.replica_set.ReplicaSet
        self.prompts = prompts
        self.sampling = sampling
        self.operation = operation
        self.model = model
        self.telemetry = telemetry  # pagedserve.gateway.request_telemetry.RequestTelemetry
        self.metadata = metadata
        self.priority = priority
        self.salt = salt
        self.public_id = public_id
        self.ids = [uuid.uuid4().hex for _ in prompts]
        self.open = len(prompts) * sampling.n
        self._open_per_prompt = [sampling.n] * len(prompts)
        self._records: dict[int, object] = {}
        self._queue: asyncio.Queue = asyncio.Queue()

    async def start(self) -> None:
        aio_loop = asyncio.get_running_loop()
        extra = {"salt": self.salt} if self.salt is not None else {}
        for k, (request_id, prompt) in enumerate(zip(self.ids, self.prompts)):
            if self.telemetry is not None:
                self._records[k] = self.telemetry.start(request_id, self.operation, self.model,
                                                        self.sampling, len(prompt), self.metadata,
                                                        self.public_id)

            def sink(item, k=k) -> None:  # called on the step thread
                try:
                    aio_loop.call_soon_threadsafe(self._queue.put_nowait, (k, item))
                except RuntimeError:  # the event loop is closed: the server is going away
                    pass

            try:
                await asyncio.wrap_future(self.runner.submit(request_id, prompt, self.sampling, sink,
                                                             self.priority, **extra))
            except RequestError as e:
                self._fail(StreamError("invalid", str(e), k))
            except QueueFull as e:
                self._fail(StreamError("queue_full", str(e), k))

    async def next_batch(self) -> list[tuple[int, Delta]]:
        if not self.open:
            return []
        k, item = await self._queue.get()
        if isinstance(item, BaseException):
            self._fail(StreamError("backend", str(item), k))
        record = self._records.get(k)
        if record is not None:
            self.telemetry.streamed(record, item)
        out = []
        for d in item:
            if d.finish_reason == "refused":  # it failed alone (its input, as the executor saw it)
                self._fail(StreamError("invalid", d.error or "refused", k))
            if d.finish_reason == "error":
                self._fail(StreamError("too_large", d.error or TOO_LARGE, k))
            if d.finish_reason:
                self.open -= 1
                self._open_per_prompt[k] -= 1
                if not self._open_per_prompt[k] and k in self._records:
                    self.telemetry.finish(self._records.pop(k))
            out.append((k * self.sampling.n + d.index, d))
        return out

    async def batches(self) -> AsyncIterator[list[tuple[int, Delta]]]:
        while self.open:
            yield await self.next_batch()

    def abort(self, code: grpc.StatusCode = grpc.StatusCode.CANCELLED,
              message: str = "the client went away") -> None:
        for request_id in self.ids:
            self.runner.abort(request_id)
        for k in list(self._records):
            self.telemetry.finish(self._records.pop(k), code, message)

    def _fail(self, error: StreamError):
        self.abort(error.code, error.message)
        raise error from None
