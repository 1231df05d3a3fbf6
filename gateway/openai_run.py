"""One HTTP request's prompts on the gateway's StepRunner, as a stream of (choice index, Delta).

Contract:
- `start()` submits every prompt (one batching-loop request each, n completions each);
  a prompt the loop refuses raises OpenAIError 400 (429 when the gateway's waiting queue
  is full) and aborts the ones already queued.
- `batches()` yields lists of (choice, delta), choice = prompt index * n + completion
  index, until every choice has its finish_reason. A request the KV pool can never hold
  raises OpenAIError 400; a failed backend step raises 503.
- `abort()` stops whatever has not finished; safe to call any time, and more than once.
  The HTTP layer calls it when the client goes away, so the sequences are freed by the
  next step's reserve.
"""
from __future__ import annotations

import asyncio
import uuid

import grpc
from typing import AsyncIterator

from gateway.requests import RequestError
from gateway.openai_errors import OpenAIError, bad_request, unavailable
from wire.protocol import Delta
from gateway.step_runner import StepRunner
from wire.protocol import SamplingParams

try:
    from gateway.step_runner import QueueFull
except ImportError:  # a StepRunner without a queue bound never refuses
    class QueueFull(Exception):
        pass


class Run:
    def __init__(self, runner: StepRunner, prompts: list[list[int]], sampling: SamplingParams,
                 prompt_param: str = "prompt", *, priority: int = 0, salt: str | None = None,
                 telemetry=None, model: str = "", headers=None):
        self.runner = runner
        self.prompts = prompts
        self.sampling = sampling
        self.prompt_param = prompt_param
        self.priority = priority
        self.salt = salt
        self.ids = [uuid.uuid4().hex for _ in prompts]
        self.open = len(prompts) * sampling.n
        self._queue: asyncio.Queue = asyncio.Queue()
        # gateway.request_telemetry: one record per prompt (spans, TTFT and latency metrics)
        self.telemetry = telemetry
        self.model = model
        self.headers = headers
        self.records: dict[int, object] = {}
        self._open_per_prompt = [sampling.n] * len(prompts)

    def _finish(self, code: grpc.StatusCode | None, message: str = "") -> None:
        if self.telemetry is None:
            return
        for k in list(self.records):
            self.telemetry.finish(self.records.pop(k), code, message)

    def _submit(self, request_id: str, prompt: list[int], sink):
        extra = {}
        if self.salt is not None:
            extra["salt"] = self.salt
        return self.runner.submit(request_id, prompt, self.sampling, sink, self.priority, **extra)

    async def start(self) -> None:
        aio_loop = asyncio.get_running_loop()
        operation = "chat" if self.prompt_param == "messages" else "text_completion"
        for k, (request_id, prompt) in enumerate(zip(self.ids, self.prompts)):
            if self.telemetry is not None:
                self.records[k] = self.telemetry.start(request_id, operation, self.model, self.sampling,
                                                       len(prompt), self.headers)
            def sink(item, k=k) -> None:  # called on the step thread
                try:
                    aio_loop.call_soon_threadsafe(self._queue.put_nowait, (k, item))
                except RuntimeError:  # the event loop is closed: the server is going away
                    pass

            try:
                await asyncio.wrap_future(self._submit(request_id, prompt, sink))
            except RequestError as e:
                self.abort(grpc.StatusCode.INVALID_ARGUMENT)
                where = f"{self.prompt_param}[{k}]" if len(self.prompts) > 1 else self.prompt_param
                raise bad_request(f"{where}: {e}", self.prompt_param) from None
            except QueueFull as e:
                self.abort(grpc.StatusCode.RESOURCE_EXHAUSTED)
                raise OpenAIError(429, str(e), code="queue_full") from None

    async def next_batch(self) -> list[tuple[int, Delta]]:
        """The next step's output of this request (empty once every choice finished)."""
        if not self.open:
            return []
        k, item = await self._queue.get()
        if isinstance(item, BaseException):
            self.abort(grpc.StatusCode.UNAVAILABLE, str(item))
            raise unavailable(str(item))
        record = self.records.get(k)
        if record is not None:
            self.telemetry.streamed(record, item)
        out = []
        for d in item:
            if d.finish_reason == "error":
                self.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, d.error or "")
                raise bad_request(d.error or "the KV pool cannot hold this request", "max_tokens")
            if d.finish_reason:
                self.open -= 1
                self._open_per_prompt[k] -= 1
                if not self._open_per_prompt[k] and record is not None:
                    self.telemetry.finish(self.records.pop(k))
            out.append((k * self.sampling.n + d.index, d))
        return out

    async def batches(self) -> AsyncIterator[list[tuple[int, Delta]]]:
        while self.open:
            yield await self.next_batch()

    def abort(self, code: grpc.StatusCode = grpc.StatusCode.CANCELLED, message: str = "") -> None:
        for request_id in self.ids:
            self.runner.abort(request_id)
        self._finish(code, message or "the client went away")
