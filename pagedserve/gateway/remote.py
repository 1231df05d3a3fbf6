"""The gateway's clients of memsvc and the executor over gRPC (pagedserve.wire.clients interfaces).

`RemoteMemoryClient` speaks for one gateway session: every call carries its session_id,
and a background heartbeat (an empty Reserve) keeps the session's lease alive while the
gateway lives, even through a long step. Failures surface as grpc.RpcError with the
server's status code and message.

Both clients carry the caller's trace context in every call (pagedserve.rpc.tracing.trace_metadata)
and the internal token when given one (pagedserve.rpc.internal_auth: in every gRPC call's metadata
and in the step channel's hello), speak TLS when given a pagedserve.rpc.tls.TlsConfig that asks for
it, and reconnect quickly to a restarted service. See docs/ARCHITECTURE.md, "One step".
"""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future

import grpc

from pagedserve.rpc.grpc_service import open_channel
from pagedserve.rpc.step_channel_client import StepChannelSlot
from pagedserve.rpc.tracing import trace_metadata
from pagedserve.wire import convert, step_convert
from pagedserve.wire.clients import ExecutorClient, MemoryClient
from pagedserve.rpc.sent import Sent
from pagedserve.wire.protocol import ModelInfo, PoolStats
from pagedserve.wire.reserve_messages import Plan, ReserveResult
from pagedserve.wire.step_delta import STATE_LOST, StepDelta, encode_delta
from pagedserve.wire.step_feed import StepOrder
from pagedserve.wire.step_outputs import StepOutputs
from pagedserve.wire.v1 import (
    executor_pb2,
    executor_pb2_grpc,
    memory_pb2,
    memory_pb2_grpc,
)


class RemoteMemoryClient(MemoryClient):
    def __init__(self, address: str, session_id: str | None = None, *, timeout: float = 60.0,
                 heartbeat_s: float = 2.0, tls=None, token: str | None = None):
        self.address = address
        self.session_id = session_id or f"gateway-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.timeout = timeout
        self.channel = open_channel(address, tls, token)
        self.stub = memory_pb2_grpc.MemoryManagerStub(self.channel)
        self._steps = StepChannelSlot(address, enabled=not (tls is not None and tls.client_enabled),
                                      token=token)
        self._last_call = time.monotonic()
        self._closed = threading.Event()
        self._heartbeat_s = heartbeat_s
        if heartbeat_s > 0:
            threading.Thread(target=self._heartbeat, name="memsvc-heartbeat", daemon=True).start()

    def reserve(self, plan: Plan) -> Future[ReserveResult]:
        request = step_convert.plan_to_proto(plan, self.session_id)
        self._last_call = time.monotonic()
        answer = self._steps.start("Reserve", self.stub.Reserve, request, memory_pb2.ReserveResponse,
                                   self.timeout)
        return Sent(lambda: step_convert.reserve_result_from_proto(answer()))

    def tables(self, seq_ids: list[str]) -> list[list[int]]:
        response = self.stub.Tables(memory_pb2.TablesRequest(session_id=self.session_id, seq_ids=seq_ids),
                                    timeout=self.timeout, metadata=trace_metadata())
        return convert.tables_from_proto(response, len(seq_ids))

    def free(self, seq_ids: list[str]) -> None:
        self._last_call = time.monotonic()
        self.stub.Free(memory_pb2.FreeRequest(session_id=self.session_id, seq_ids=seq_ids),
                       timeout=self.timeout, metadata=trace_metadata())

    def fork(self, parent_id: str, child_id: str) -> None:
        self._last_call = time.monotonic()
        self.stub.Fork(memory_pb2.ForkRequest(session_id=self.session_id, parent_id=parent_id,
                                              child_id=child_id),
                       timeout=self.timeout, metadata=trace_metadata())

    def stats(self) -> PoolStats:
        response = self.stub.Stats(memory_pb2.StatsRequest(), timeout=self.timeout,
                                   metadata=trace_metadata())
        return convert.stats_from_proto(response)

    def _heartbeat(self) -> None:
        empty = memory_pb2.ReserveRequest(session_id=self.session_id)
        while not self._closed.wait(self._heartbeat_s / 2):
            if time.monotonic() - self._last_call < self._heartbeat_s:
                continue
            try:
                self.stub.Reserve(empty, timeout=self._heartbeat_s)
                self._last_call = time.monotonic()
            except grpc.RpcError:
                pass  # memsvc away or not ready; the next real call reports it

    def close(self) -> None:
        self._closed.set()
        self._steps.close()
        self.channel.close()


class RemoteExecutorClient(ExecutorClient):
    """`model_info()` is fetched once; its tokenizer files land in a temporary directory
    (removed by `close()` or at exit) that the returned ModelInfo names. The executor
    service runs numbered steps in order and fills fed tokens itself (pagedserve.wire.step_feed).
    `tables` (memsvc's: MemoryClient.tables) gives the whole block tables a sequence's state
    goes with when the executor does not hold it (it restarted, or a step failed)."""

    def __init__(self, address: str, *, timeout: float | None = None, info_timeout: float = 60.0,
                 tls=None, session_id: str | None = None, token: str | None = None,
                 tables: Callable[[list[str]], list[list[int]]] | None = None):
        self.address = address
        self.tables = tables
        self.session_id = session_id or f"gateway-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.incarnation = ""  # the executor process that holds our sequences' state
        self._sent: set[str] = set()  # the sequences whose state the executor holds
        self._lock = threading.Lock()  # two steps may be in flight (pagedserve.gateway.overlap)
        self._encoded = StepOrder()  # steps are encoded in their order: `sent` says
        # what the executor holds once the steps before have run
        self.num_resyncs = 0
        self._first = 0  # the first step sent since the last answer named an incarnation
        self.timeout = timeout
        self.info_timeout = info_timeout
        self.channel = open_channel(address, tls, token)
        self.stub = executor_pb2_grpc.ExecutorStub(self.channel)
        self._steps = StepChannelSlot(address, enabled=not (tls is not None and tls.client_enabled),
                                      token=token)
        self._info: ModelInfo | None = None
        self._tokenizer_dir: str | None = None

    def model_info(self) -> ModelInfo:
        if self._info is None:
            response = self.stub.ModelInfo(executor_pb2.ModelInfoRequest(), timeout=self.info_timeout,
                                           metadata=trace_metadata())
            self._info = model_info_with_tokenizer(response)
            self._tokenizer_dir = self._info.tokenizer_dir
        return self._info

    def step(self, step: StepDelta) -> Future[StepOutputs]:
        """Sends each sequence's state once, then only its changes (pagedserve.wire.step_delta); an
        executor that lost that state (it restarted) gets all of it. So does a step encoded
        before the step ahead of it was sent again that way, if it was refused (state
        lost, or a block table change the executor never had: the step before it failed
        before changing anything)."""
        answer, resyncs = self._send(step)

        def result() -> StepOutputs:
            try:
                return answer()
            except grpc.RpcError as e:
                code, details = e.code(), e.details() or ""
                lost = code == grpc.StatusCode.FAILED_PRECONDITION and STATE_LOST in details
                behind = (code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)
                          and self.num_resyncs != resyncs)
                if not (lost or behind):
                    raise
            with self._lock:
                self._sent.clear()
                self.incarnation = ""
                self.num_resyncs += 1
                self._first = 0
            return self._send(step)[0]()
        return Sent(result)

    def _send(self, step: StepDelta) -> tuple[Callable[[], StepOutputs], int]:
        """The step's answer, to read later, and `num_resyncs` as the step was encoded."""
        # What goes out counts as held at once: the next step may be encoded before this
        # one is answered. After a failure what the executor holds is unknown: all again.
        self._encoded.wait_turn(step.step)
        try:
            with self._lock:
                request = encode_delta(step, self._sent, self.session_id, self.incarnation, self.tables)
                if not self.incarnation:  # no answer yet: the executor's order starts at our first step
                    self._first = self._first or step.step
                    request.first_step = self._first
                resyncs = self.num_resyncs
        finally:
            self._encoded.passed(step.step)
        answer = self._steps.start("Execute", self.stub.Execute, request, executor_pb2.ExecuteResponse,
                                   self.timeout)

        def result() -> StepOutputs:
            try:
                response = answer()
            except grpc.RpcError:
                with self._lock:
                    self._sent.clear()
                raise
            with self._lock:
                if response.incarnation != self.incarnation:
                    if self.incarnation:  # answered by another process than the one holding our state
                        self._sent.clear()
                    self.incarnation = response.incarnation
            return step_convert.outputs_from_proto(response, step.sampled_ids())
        return result, resyncs

    def close(self) -> None:
        self._steps.close()
        self.channel.close()
        if self._tokenizer_dir:
            shutil.rmtree(self._tokenizer_dir, ignore_errors=True)


def model_info_with_tokenizer(response: executor_pb2.ModelInfoResponse, directory: str | None = None
                              ) -> ModelInfo:
    """Write the response's tokenizer files into `directory` (default: a new temporary one,
    removed at exit) and return the ModelInfo whose tokenizer_dir is that directory."""
    if directory is None:
        directory = tempfile.mkdtemp(prefix="pagedserve-tokenizer-")
        atexit.register(shutil.rmtree, directory, True)
    for f in response.tokenizer_files:
        name = os.path.basename(f.name)
        if not name or name != f.name or name.startswith("."):
            raise ValueError(f"the executor sent a tokenizer file with a bad name: {f.name!r}")
        with open(os.path.join(directory, name), "wb") as out:
            out.write(f.content)
    return convert.model_info_from_proto(response, directory)


def tokenizer_dir_from_info(info: ModelInfo) -> str:
    """The directory to load the tokenizer from: RemoteExecutorClient.model_info() already
    wrote the executor's tokenizer files there."""
    return info.tokenizer_dir
