"""The public pagedserve.v1.Generation service on grpc.aio, plus health and reflection.

Contract:
- Generate / Chat stream GenerateResponse messages; each of the n completions ends with a
  message carrying its finish_reason (stop, length). usage is on every message.
- INVALID_ARGUMENT for a bad request (the message names the field), RESOURCE_EXHAUSTED for
  a request the KV pool can never hold, UNAVAILABLE while the backend is not ready or when
  a step fails. Other requests keep going.
- A client that cancels, disconnects or passes its deadline has its request aborted before
  the next step; its blocks are freed by the next Reserve.
- grpc.health.v1 says NOT_SERVING until the backend answers (executor ModelInfo, memsvc
  reachable), then SERVING.

The backend is whatever `connect()` returns: the in-process MemoryManager and Executor
(tests) or the gRPC clients of memsvc and the executor (deployment).
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gateway.api_request import ApiError, chat_prompt, check_model, generate_prompt, sampling_from_proto
from gateway.batch_loop import BatchLoop, RequestError
from gateway.output_stream import Delta
from gateway.scheduler import SchedulerConfig
from gateway.step_runner import StepRunner, describe
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc

log = logging.getLogger("pagedserve.gateway")
SERVICE = pb.DESCRIPTOR.services_by_name["Generation"].full_name
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass
class Backend:
    """What the gateway runs on: memsvc and executor clients, and the model's tokenizer.

    `check` raises unless both services can do their job (default: ask each for its state).
    """

    memory: Any  # gateway.clients.MemoryClient
    executor: Any  # gateway.clients.ExecutorClient
    tokenizer: Any = None
    check: Callable[[], None] | None = None

    def probe(self) -> None:
        if self.check is not None:
            self.check()
        else:
            self.executor.model_info()
            self.memory.stats()


def to_response(d: Delta, request_id: str) -> pb.GenerateResponse:
    r = pb.GenerateResponse(
        index=d.index, text=d.text, token_ids=d.token_ids, finish_reason=d.finish_reason or "",
        request_id=request_id,
        usage=pb.Usage(prompt_tokens=d.prompt_tokens, completion_tokens=d.completion_tokens,
                       cached_tokens=d.cached_tokens),
    )
    for i, lp in enumerate(d.logprobs):
        top = d.top_logprobs[i] if i < len(d.top_logprobs) else []
        r.logprobs.append(pb.TokenLogprob(
            token_id=d.token_ids[i], logprob=lp,
            top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in top]))
    return r


class GenerationService(pb_grpc.GenerationServicer):
    def __init__(self, scheduler: SchedulerConfig):
        self.scheduler_config = scheduler
        self.backend: Backend | None = None
        self.runner: StepRunner | None = None
        self.info = None

    def attach(self, backend: Backend, on_step_error=None, on_step_ok=None) -> None:
        loop = BatchLoop(backend.memory, backend.executor, self.scheduler_config, backend.tokenizer)
        self.info = loop.info
        self.backend = backend
        self.runner = StepRunner(loop, on_step_error, on_step_ok)

    async def Generate(self, request, context):
        async for r in self._guarded(context, lambda: generate_prompt(request, self._tokenizer()),
                                     request.model, request.sampling, request.priority,
                                     request.request_id):
            yield r

    async def Chat(self, request, context):
        async for r in self._guarded(context, lambda: chat_prompt(request, self._tokenizer()),
                                     request.model, request.sampling, request.priority,
                                     request.request_id):
            yield r

    async def ListModels(self, request, context):
        try:
            self._ready_or_raise_sync()
        except ApiError as e:
            await context.abort(e.code, e.message)
        return pb.ListModelsResponse(models=[pb.ModelCard(name=self.info.name,
                                                          max_model_len=self.info.max_model_len)])

    async def Tokenize(self, request, context):
        try:
            self._ready_or_raise_sync()
            check_model(request.model, self.info)
            if self.backend.tokenizer is None:
                raise ApiError(grpc.StatusCode.FAILED_PRECONDITION, "this model has no tokenizer")
        except ApiError as e:
            await context.abort(e.code, e.message)
        ids = self.backend.tokenizer(request.text, add_special_tokens=request.add_special_tokens)
        return pb.TokenizeResponse(token_ids=ids["input_ids"])

    def _tokenizer(self):
        return self.backend.tokenizer

    def _ready_or_raise_sync(self) -> None:
        if self.runner is None:
            raise ApiError(grpc.StatusCode.UNAVAILABLE,
                           "the gateway is starting: waiting for the executor and memsvc")

    async def _guarded(self, context, prompt: Callable[[], list[int]], model: str, sampling_pb,
                       priority: int, client_request_id: str):
        try:
            self._ready_or_raise_sync()
            check_model(model, self.info)
            sampling = sampling_from_proto(sampling_pb)
            prompt_ids = prompt()
        except ApiError as e:
            await context.abort(e.code, e.message)
        async for r in self._stream(context, prompt_ids, sampling, priority, client_request_id):
            yield r

    async def _stream(self, context, prompt_ids, sampling, priority, client_request_id):
        runner = self.runner
        request_id = uuid.uuid4().hex
        public_id = client_request_id or request_id
        queue: asyncio.Queue = asyncio.Queue()
        aio_loop = asyncio.get_running_loop()

        def sink(item) -> None:  # called on the step thread
            try:
                aio_loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the event loop is closed: the server is going away
                pass

        done = False
        try:
            try:
                await asyncio.wrap_future(runner.submit(request_id, prompt_ids, sampling, sink, priority))
            except RequestError as e:
                done = True
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            open_completions = sampling.n
            while open_completions:
                item = await queue.get()
                if isinstance(item, BaseException):
                    done = True
                    await context.abort(grpc.StatusCode.UNAVAILABLE, str(item))
                for d in item:
                    if d.finish_reason == "error":
                        done = True
                        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                            d.error or "the KV pool cannot hold this request")
                    if d.finish_reason:
                        open_completions -= 1
                    yield to_response(d, public_id)
            done = True
        finally:
            if not done:
                runner.abort(request_id)


class Gateway:
    """The gRPC server: Generation, health and reflection; connects to the backend in the background."""

    def __init__(self, connect: Callable[[], Backend], scheduler: SchedulerConfig | None = None,
                 host: str = "127.0.0.1", port: int = 50051, retry_seconds: float = 1.0):
        self.connect = connect
        self.service = GenerationService(scheduler or SchedulerConfig())
        self.health = health.aio.HealthServicer()
        self.address = f"{host}:{port}"
        self.retry_seconds = retry_seconds
        self.server: grpc.aio.Server | None = None
        self.port: int | None = None
        self.ready = asyncio.Event()
        self._recovering = False
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> int:
        """Listen (NOT_SERVING), start connecting to the backend; return the bound port."""
        self.server = grpc.aio.server()
        pb_grpc.add_GenerationServicer_to_server(self.service, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection([SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME],
                                            self.server)
        self.port = self.server.add_insecure_port(self.address)
        if self.port == 0:
            raise RuntimeError(f"cannot listen on {self.address}")
        await self._set_health(NOT_SERVING)
        await self.server.start()
        self._spawn(self._connect())
        return self.port

    async def stop(self, grace: float = 1.0) -> None:
        for task in self._tasks:
            task.cancel()
        if self.server is not None:
            await self.health.enter_graceful_shutdown()
            await self.server.stop(grace)
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
        self.service.attach(
            backend,
            on_step_error=lambda e: aio_loop.call_soon_threadsafe(self._on_backend_failed),
        )
        info = self.service.info
        log.info("serving %s (max length %d) on %s", info.name, info.max_model_len, self.address)
        await self._set_health(SERVING)
        self.ready.set()

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
