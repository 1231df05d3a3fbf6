"""The public pagedserve.v1.Generation service on grpc.aio, plus health and reflection.

Contract:
- The model is served under `served_model_name` (--served-model-name; off: the executor's
  name): ListModels lists every name, a request naming another is NOT_FOUND
  (pagedserve.wire.served_names).
- Generate / Chat stream GenerateResponse messages; each of the n completions ends with a
  message carrying its finish_reason (stop, length). usage is on every message. With
  `reasoning_parser` (--reasoning-parser), a Chat without a grammar has its output split as
  the HTTP API's (pagedserve.gateway.reasoning): the reasoning in `reasoning`, the answer in `text`.
- INVALID_ARGUMENT for a bad request, a field this gateway's proto lacks among them (the
  message names the field and what it may hold:
  pagedserve.wire.sampling_fields, pagedserve.gateway.request_limits), before anything is queued;
  RESOURCE_EXHAUSTED for a request the KV pool can never hold, UNAVAILABLE while the
  backend is not ready or when a step fails. Other requests keep going.
- Requests are read (checked, grammars prepared, prompts tokenized) on the service's
  `parse_pool` (pagedserve.gateway.parse_pool), shared with the HTTP API, never on the event loop.
- A client that cancels, disconnects or passes its deadline has its request aborted before
  the next step; its blocks are freed by the next Reserve.
- grpc.health.v1 says NOT_SERVING until the backend answers (executor ModelInfo, memsvc
  reachable), then SERVING; NOT_SERVING again while a step is being retried through a
  backend restart (pagedserve.gateway.step_retry) and from the start of a graceful stop.
- Queue bound: with `max_waiting`, a request beyond it is RESOURCE_EXHAUSTED.
- API key: with `api_key`, every call but health checks needs metadata
  `authorization: Bearer <key>` (or `x-api-key: <key>`), else UNAUTHENTICATED.
- Messages over `max_message_bytes` (default 4 MiB) are refused with RESOURCE_EXHAUSTED;
  bytes that do not parse as the request message with INVALID_ARGUMENT.
- `drain(timeout)` (SIGTERM): health NOT_SERVING, new requests of both APIs UNAVAILABLE
  (HTTP 503), the requests running on either API get up to `timeout` seconds to finish;
  those still running then end with UNAVAILABLE (an HTTP stream: an error event and
  `data: [DONE]`). `stop(grace)`: drain(grace), then close the server and the backend.
- Telemetry: one span per request (GenAI attributes, a child of the client's traceparent),
  per-step spans linked to the requests (pagedserve.gateway.step_telemetry), Prometheus metrics in
  `service.metrics` (pagedserve.gateway.metrics).

The backend is whatever `connect()` returns: the in-process MemoryManager and Executor
(tests), the gRPC clients of memsvc and the executor (deployment), or a connected
pagedserve.gateway.replica_set.ReplicaSet (several replicas, routed; the health is SERVING while
any replica is up).
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pagedserve.gateway.api_key import ApiKeyInterceptor
from pagedserve.gateway.api_request import (ApiError, chat_prompt, check_known_fields, check_model,
                                            check_request_field, check_text_size, generate_prompt,
                                            sampling_from_proto)
from pagedserve.gateway.batch_loop import BatchLoop
from pagedserve.gateway.in_process import step_clients
from pagedserve.gateway.metrics import GatewayMetrics
from pagedserve.gateway.parse_pool import ParsePool
from pagedserve.gateway.reasoning import ReasoningStream, parser_for
from pagedserve.gateway.request_limits import utf8_size
from pagedserve.gateway.request_guard import DecodeGuard
from pagedserve.gateway.request_stream import RequestStream, StreamError
from pagedserve.gateway.request_telemetry import RequestTelemetry
from pagedserve.gateway.scheduler_config import SchedulerConfig
from pagedserve.gateway.step_retry import StepRetry
from pagedserve.gateway.step_runner import StepRunner, describe
from pagedserve.gateway.step_telemetry import ObservedExecutor, ObservedMemory
from pagedserve.wire.convert import prompt_logprobs_to_proto
from pagedserve.wire.protocol import Delta
from pagedserve.wire.served_names import named, names_of
from pagedserve.wire.v1 import generation_pb2 as pb
from pagedserve.wire.v1 import generation_pb2_grpc as pb_grpc

log = logging.getLogger("pagedserve.gateway")
SERVICE = pb.DESCRIPTOR.services_by_name["Generation"].full_name
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
PUBLIC_MAX_MESSAGE_BYTES = 4 << 20
END_WAIT_S = 2.0  # after the drain: how long requests ended by it get to say so


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


class Gateway:
    """The gRPC server: Generation, health and reflection; connects to the backend in the background."""

    def __init__(self, connect: Callable[[], Backend], scheduler: SchedulerConfig | None = None,
                 host: str = "127.0.0.1", port: int = 50051, retry_seconds: float = 1.0, *,
                 max_waiting: int = 0, step_retry_s: float = 60.0, api_key: str | None = None,
                 credentials: grpc.ServerCredentials | None = None,
                 max_message_bytes: int = PUBLIC_MAX_MESSAGE_BYTES, metrics: GatewayMetrics | None = None,
                 reasoning_parser: str | None = None, served_model_name: list[str] | None = None):
        self.connect = connect
        self.service = GenerationService(scheduler or SchedulerConfig(), max_waiting, step_retry_s, metrics,
                                         reasoning_parser, served_model_name)
        self.health = health.aio.HealthServicer()
        self.address = f"{host}:{port}"
        self.retry_seconds = retry_seconds
        self.api_key = api_key
        self.credentials = credentials
        self.max_message_bytes = max_message_bytes
        self.server: grpc.aio.Server | None = None
        self.port: int | None = None
        self.ready = asyncio.Event()
        self._recovering = False
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> int:
        """Listen (NOT_SERVING), start connecting to the backend; return the bound port."""
        interceptors = [ApiKeyInterceptor(self.api_key)] if self.api_key else []
        interceptors.append(DecodeGuard())
        self.server = grpc.aio.server(interceptors=interceptors, options=[
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_send_message_length", self.max_message_bytes)])
        pb_grpc.add_GenerationServicer_to_server(self.service, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection([SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME],
                                            self.server)
        if self.credentials is not None:
            self.port = self.server.add_secure_port(self.address, self.credentials)
        else:
            self.port = self.server.add_insecure_port(self.address)
        if self.port == 0:
            raise RuntimeError(f"cannot listen on {self.address}")
        await self._set_health(NOT_SERVING)
        await self.server.start()
        self._spawn(self._connect())
        return self.port

    async def drain(self, timeout: float) -> int:
        """Admit nothing new and let what runs finish, at most `timeout` seconds (see the
        module's contract); returns how many requests were still running then and ended."""
        for task in self._tasks:
            task.cancel()
        self.service.draining = True
        await self.health.enter_graceful_shutdown()
        clock = asyncio.get_running_loop().time
        deadline = clock() + timeout
        while self._busy() and clock() < deadline:
            await asyncio.sleep(0.05)
        runner = self.service.runner
        left = runner.in_flight() if runner is not None else 0
        if left:
            log.info("%d requests still running after --drain-timeout %gs; ending them", left, timeout)
            runner.end_all(f"the gateway is shutting down and this request did not finish within "
                           f"its --drain-timeout ({timeout:g}s): retry it on another replica")
        deadline = clock() + END_WAIT_S
        while self._busy() and clock() < deadline:
            await asyncio.sleep(0.05)
        return left

    def _busy(self) -> bool:
        """A request of either API in flight, or a gRPC stream not yet ended."""
        runner = self.service.runner
        return bool(self.service.active or (runner is not None and runner.in_flight()))

    async def stop(self, grace: float = 1.0) -> None:
        """drain(grace), then stop the gRPC server, the step runner and the backend clients."""
        await self.drain(grace)
        if self.server is not None:
            await self.server.stop(END_WAIT_S)  # returns once no call is left
        self.service.parse_pool.close()
        if self.service.runner is not None:
            await asyncio.to_thread(self.service.runner.stop)
        backend = self.service.backend
        for client in (backend.memory, backend.executor) if backend else ():
            close = getattr(client, "close", None)
            if close is not None:
                close()

    async def _connect(self) -> None:
        backend = await self._until_ok(self.connect, "connecting to the backend")
        aio_loop = asyncio.get_running_loop()
        if not isinstance(backend, Backend):  # several replicas: they fail over among themselves
            self.service.attach_replicas(backend)

            def on_change(any_up: bool) -> None:  # SERVING while a replica is up
                if not self.service.draining:
                    self._spawn(self._set_health(SERVING if any_up else NOT_SERVING))
            backend.on_change = lambda any_up: aio_loop.call_soon_threadsafe(on_change, any_up)
        else:
            self.service.attach(
                backend,
                on_step_error=lambda e: aio_loop.call_soon_threadsafe(self._on_backend_failed),
            )
        info = self.service.info
        log.info("serving %s (max length %d) on %s", info.name, info.max_model_len, self.address)
        await self._set_health(SERVING)
        self.ready.set()

    @property
    def recovering(self) -> bool:
        """A step failed and the backend has not answered a probe since (health NOT_SERVING)."""
        return self._recovering

    @property
    def serving(self) -> bool:
        """Connected, not recovering and not shutting down: what the HTTP API's /health says."""
        return self.ready.is_set() and not self._recovering and not self.service.draining

    def _on_backend_failed(self) -> None:
        if not self._recovering:
            self._recovering = True
            self._spawn(self._recover())

    async def _recover(self) -> None:
        await self._set_health(NOT_SERVING)
        await self._until_ok(self.service.backend.probe, "waiting for the backend")
        self._recovering = False
        await self._set_health(SERVING)

    async def _until_ok(self, fn, what: str):
        while True:
            try:
                return await asyncio.to_thread(fn)
            except Exception as e:
                log.info("%s: %s; retrying in %.1fs", what, describe(e), self.retry_seconds)
                await asyncio.sleep(self.retry_seconds)

    async def _set_health(self, status) -> None:
        await self.health.set("", status)
        await self.health.set(SERVICE, status)

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
