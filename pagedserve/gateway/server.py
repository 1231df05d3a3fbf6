"""The public pagedserve.v1.Generation service on grpc.aio (its servicer:
pagedserve.gateway.generation_service), plus health and reflection, and the gateway's life:
connecting to its backend, recovering, draining.

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
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pagedserve.gateway.api_key import ApiKeyInterceptor
from pagedserve.gateway.generation_service import Backend, GenerationService
from pagedserve.gateway.metrics import GatewayMetrics
from pagedserve.gateway.request_guard import DecodeGuard
from pagedserve.gateway.scheduler_config import SchedulerConfig
from pagedserve.gateway.step_runner import describe
from pagedserve.wire.v1 import generation_pb2 as pb
from pagedserve.wire.v1 import generation_pb2_grpc as pb_grpc

log = logging.getLogger("pagedserve.gateway")
SERVICE = pb.DESCRIPTOR.services_by_name["Generation"].full_name
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
PUBLIC_MAX_MESSAGE_BYTES = 4 << 20
END_WAIT_S = 2.0  # after the drain: how long requests ended by it get to say so


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
