"""The pagedserve.v1.Generation servicer: requests read, checked and streamed through the
batching loop; the contract is pagedserve.gateway.server's, which serves it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import grpc

from pagedserve.gateway.api_request import (ApiError, chat_prompt, check_known_fields, check_model,
                                            check_request_field, check_text_size, generate_prompt,
                                            sampling_from_proto)
from pagedserve.gateway.batch_loop import BatchLoop
from pagedserve.gateway.in_process import step_clients
from pagedserve.gateway.metrics import GatewayMetrics
from pagedserve.gateway.parse_pool import ParsePool
from pagedserve.gateway.reasoning import ReasoningStream, parser_for
from pagedserve.gateway.request_limits import utf8_size
from pagedserve.gateway.request_stream import RequestStream, StreamError
from pagedserve.gateway.request_telemetry import RequestTelemetry
from pagedserve.gateway.scheduler_config import SchedulerConfig
from pagedserve.gateway.step_retry import StepRetry
from pagedserve.gateway.step_runner import StepRunner
from pagedserve.gateway.step_telemetry import ObservedExecutor, ObservedMemory
from pagedserve.wire.convert import prompt_logprobs_to_proto
from pagedserve.wire.protocol import Delta
from pagedserve.wire.served_names import named, names_of
from pagedserve.wire.v1 import generation_pb2 as pb
from pagedserve.wire.v1 import generation_pb2_grpc as pb_grpc


@dataclass
class Backend:
    """What the gateway runs on: memsvc and executor clients, and the model's tokenizer.

    `check` raises unless both services can do their job (default: ask each for its state).
    """

    memory: Any  # a pagedserve.wire.clients.MemoryClient, or an object pagedserve.gateway.in_process wraps
    executor: Any  # a pagedserve.wire.clients.ExecutorClient, or an object pagedserve.gateway.in_process wraps
    tokenizer: Any = None
    check: Callable[[], None] | None = None

    def probe(self) -> None:
        if self.check is not None:
            self.check()
        else:
            self.executor.model_info()
            self.memory.stats()


def to_response(d: Delta, request_id: str, split: ReasoningStream | None = None) -> pb.GenerateResponse:
    """`d` as a message; `split`: its completion's reasoning parser, which d.text goes through."""
    reasoning, text = split.step(d.text, bool(d.finish_reason)) if split is not None else ("", d.text)
    r = pb.GenerateResponse(
        index=d.index, text=text, reasoning=reasoning, token_ids=d.token_ids,
        finish_reason=d.finish_reason or "", request_id=request_id,
        usage=pb.Usage(prompt_tokens=d.prompt_tokens, completion_tokens=d.completion_tokens,
                       cached_tokens=d.cached_tokens),
    )
    for i, lp in enumerate(d.logprobs):
        top = d.top_logprobs[i] if i < len(d.top_logprobs) else []
        r.logprobs.append(pb.TokenLogprob(
            token_id=d.token_ids[i], logprob=lp,
            top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in top]))
    if d.prompt_logprobs:
        r.prompt_logprobs.extend(prompt_logprobs_to_proto(d.prompt_logprobs))
    return r


class GenerationService(pb_grpc.GenerationServicer):
    def __init__(self, scheduler: SchedulerConfig, max_waiting: int = 0, step_retry_s: float = 60.0,
                 metrics: GatewayMetrics | None = None, reasoning_parser: str | None = None,
                 served_model_name: list[str] | None = None):
        self.scheduler_config = scheduler
        self.served_names = list(served_model_name or [])  # off: the executor's name (wire.served_names)
        self.reasoning_parser = reasoning_parser  # both APIs' (pagedserve.gateway.reasoning)
        self.max_waiting = max_waiting
        self.step_retry_s = step_retry_s
        self.metrics = metrics or GatewayMetrics()
        self.telemetry = RequestTelemetry(self.metrics)
        self.backend: Backend | None = None
        self.runner: StepRunner | None = None
        self.info = None
        self.draining = False
        self.active = 0  # streams in progress
        self.parse_pool = ParsePool()

    def attach(self, backend: Backend, on_step_error=None, on_step_ok=None) -> None:
        """Run on `backend`: steps retried through service restarts, observed, then batched."""
        runner = self.build_runner(backend, on_step_error, on_step_ok)
        self.info = named(runner.loop.info, self.served_names)
        self.backend = backend
        self.runner = runner
        self.metrics.watch_scheduler(lambda: runner.loop.scheduler, self.info.name)

    def build_runner(self, backend: Backend, on_step_error=None, on_step_ok=None) -> StepRunner:
        """A step runner on `backend` (one per replica when there are several)."""
        def on_retry(call: str, error: BaseException) -> None:
            self.metrics.step_retries.labels(call).inc()
            if on_step_error is not None:
                on_step_error(error)

        clients = step_clients(backend.memory, backend.executor, self.scheduler_config.overlap)
        retry = StepRetry(*clients, self.step_retry_s, on_retry=on_retry)
        block_size = retry.executor.model_info().kv.block_size
        memory = ObservedMemory(retry.memory, self.telemetry, block_size)
        executor = ObservedExecutor(retry.executor, self.telemetry, memory)
        loop = BatchLoop(memory, executor, self.scheduler_config, backend.tokenizer)
        memory.request_of = loop.request_of
        return StepRunner(loop, on_step_error, on_step_ok, max_waiting=self.max_waiting)

    def attach_replicas(self, replicas) -> None:
        """Run on several replicas (pagedserve.gateway.replica_set.ReplicaSet, connected): it routes each
        request to one of them and stands in for the step runner."""
        self.info = named(replicas.info, self.served_names)
        self.backend = Backend(None, None, replicas.backend.tokenizer)
        self.runner = replicas
        self.metrics.watch_scheduler(replicas.queues, self.info.name)

    async def Generate(self, request, context):
        async for r in self._guarded(context, request, lambda: generate_prompt(request, self._tokenizer(),
                                                                               self.info.max_model_len),
                                     request.model, request.sampling, request.priority,
                                     request.request_id, "text_completion", request.cache_salt):
            yield r

    async def Chat(self, request, context):
        async for r in self._guarded(context, request, lambda: chat_prompt(request, self._tokenizer(),
                                                                           self.info.max_model_len),
                                     request.model, request.sampling, request.priority,
                                     request.request_id, "chat", request.cache_salt, chat=True):
            yield r

    async def ListModels(self, request, context):
        try:
            self._ready_or_raise_sync()
            check_known_fields(request)
        except ApiError as e:
            await context.abort(e.code, e.message)
        return pb.ListModelsResponse(models=[pb.ModelCard(name=name, max_model_len=self.info.max_model_len)
                                             for name in names_of(self.info)])

    async def Tokenize(self, request, context):
        try:
            self._ready_or_raise_sync()
            check_known_fields(request)
            check_model(request.model, self.info)
            if self.backend.tokenizer is None:
                raise ApiError(grpc.StatusCode.FAILED_PRECONDITION, "this model has no tokenizer")
            tokenizer, max_len = self.backend.tokenizer, self.info.max_model_len

            def tokenize() -> list[int]:
                check_text_size(utf8_size(request.text), max_len, tokenizer, "text")
                return tokenizer(request.text, add_special_tokens=request.add_special_tokens)["input_ids"]

            ids = await self.parse_pool.run(tokenize)
        except ApiError as e:
            await context.abort(e.code, e.message)
        return pb.TokenizeResponse(token_ids=ids)

    def _tokenizer(self):
        return self.backend.tokenizer

    def _ready_or_raise_sync(self) -> None:
        if self.draining:
            raise ApiError(grpc.StatusCode.UNAVAILABLE,
                           "the gateway is shutting down: retry on another replica")
        if self.runner is None:
            raise ApiError(grpc.StatusCode.UNAVAILABLE,
                           "the gateway is starting: waiting for the executor and memsvc")

    async def _guarded(self, context, request, prompt: Callable[[], list[int]], model: str, sampling_pb,
                       priority: int, client_request_id: str, operation: str, salt: str = "",
                       chat: bool = False):
        def read() -> tuple:
            check_known_fields(request)
            check_request_field("cache_salt", salt)
            check_request_field("request_id", client_request_id)
            return sampling_from_proto(sampling_pb, self.info.max_model_len), prompt()

        try:
            self._ready_or_raise_sync()
            check_model(model, self.info)
            sampling, prompt_ids = await self.parse_pool.run(read)
            self._ready_or_raise_sync()  # a drain may have begun while it was read
        except ApiError as e:
            self.metrics.errors.labels(e.code.name).inc()
            await context.abort(e.code, e.message)
        self.active += 1
        try:
            async for r in self._stream(context, prompt_ids, sampling, priority, client_request_id,
                                        operation, salt or None,
                                        parser_for(self.reasoning_parser, chat, sampling)):
                yield r
        finally:
            self.active -= 1

    async def _stream(self, context, prompt_ids, sampling, priority, client_request_id, operation,
                      salt: str | None = None, reasoning: str | None = None):
        stream = RequestStream(self.runner, [prompt_ids], sampling, operation=operation,
                               model=self.info.name, telemetry=self.telemetry,
                               metadata=context.invocation_metadata(), priority=priority, salt=salt,
                               public_id=client_request_id)
        public_id = client_request_id or stream.ids[0]
        splits: dict[int, ReasoningStream] = {}  # completion index -> its parser
        ended = False
        try:
            await stream.start()
            async for batch in stream.batches():
                for _, d in batch:
                    if reasoning and d.index not in splits:
                        splits[d.index] = ReasoningStream(reasoning)
                    yield to_response(d, public_id, splits.get(d.index))
            ended = True
        except StreamError as e:
            ended = True
            await context.abort(e.code, e.message)
        finally:
            if not ended:
                left = context.time_remaining()
                stream.abort(grpc.StatusCode.DEADLINE_EXCEEDED if left is not None and left <= 0
                             else grpc.StatusCode.CANCELLED)
