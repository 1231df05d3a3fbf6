"""The step channel's client side: one connection's calls (`StepChannelClient`) and the
slot a gRPC client keeps it in (`StepChannelSlot`); the contract: pagedserve.rpc.step_channel."""
from __future__ import annotations

import itertools
import select
import socket
import threading
import time
from typing import Callable

import grpc

from pagedserve.rpc.step_channel import (CODES, CONNECT_TIMEOUT_S, HEADER, HELLO, METHODS, StepChannelError, log,
                                         read_frame, read_hello, tune)
from pagedserve.rpc.tracing import trace_metadata


class StepChannelClient:
    """Calls on one connection. `send` writes a call's frame and returns its id; `answer`
    reads the answers on the thread that waits for one (no reader thread, so no handoff
    between threads per call): answers to other calls are kept for their callers, and
    one thread reads at a time while the others wait for it."""

    def __init__(self, host: str, port: int, token: str | None = None):
        self.port = port
        self._sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
        try:
            tune(self._sock)
            self._say_hello(token)
        except BaseException:
            self._sock.close()
            raise
        self._sock.settimeout(None)
        self._answers: dict[int, tuple[int, bytes]] = {}
        self._waiting: set[int] = set()  # calls sent and not answered yet
        self._ids = itertools.count(1)
        self._write = threading.Lock()
        self._cond = threading.Condition()
        self._reading = False
        self._why = ""
        self.alive = True

    def _say_hello(self, token: str | None) -> None:
        """The connection's first frame (OSError, or StepChannelError when refused)."""
        body = (token or "").encode()
        self._sock.sendall(HEADER.pack(len(body), 0, HELLO) + body)
        status, details = read_hello(self._sock)
        if status:
            raise StepChannelError(CODES.get(status, grpc.StatusCode.UNKNOWN), details.decode(errors="replace"))

    def call(self, method: str, request, response_type, timeout: float | None = None):
        return self.answer(self.send(method, request), method, response_type, timeout)

    def send(self, method: str, request) -> int:
        payload = request.SerializeToString()
        with self._write:
            if not self.alive:
                raise StepChannelError(grpc.StatusCode.UNAVAILABLE, "the step channel closed")
            call_id = next(self._ids)
            with self._cond:
                self._waiting.add(call_id)
            try:
                self._sock.sendall(HEADER.pack(len(payload), call_id, METHODS[method]) + payload)
            except OSError as e:
                self._broken(f"the step channel broke: {e}")
                raise StepChannelError(grpc.StatusCode.UNAVAILABLE, f"the step channel broke: {e}") from None
        return call_id

    def answer(self, call_id: int, method: str, response_type, timeout: float | None = None):
        """The response to call `call_id` (StepChannelError: the call failed, the channel
        broke, or no answer came in `timeout` seconds)."""
        status, body = self._wait(call_id, method, timeout)
        if status:
            raise StepChannelError(CODES.get(status, grpc.StatusCode.UNKNOWN), body.decode(errors="replace"))
        return response_type.FromString(body)

    def _wait(self, call_id: int, method: str, timeout: float | None) -> tuple[int, bytes]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._cond:
                while True:
                    if call_id in self._answers:
                        self._waiting.discard(call_id)
                        return self._answers.pop(call_id)
                    if not self.alive:
                        self._waiting.discard(call_id)
                        return grpc.StatusCode.UNAVAILABLE.value[0], self._why.encode()
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        self._waiting.discard(call_id)
                        raise StepChannelError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                               f"{method} over the step channel: no answer in {timeout}s")
                    if not self._reading:
                        self._reading = True
                        break
                    self._cond.wait(left)
            try:
                self._read_one(left)
            finally:
                with self._cond:
                    self._reading = False
                    self._cond.notify_all()

    def _read_one(self, timeout: float | None) -> None:
        """Read one answer, if one comes in `timeout` seconds, into `_answers` (this thread
        is the one reading)."""
        try:
            if timeout is not None and not select.select([self._sock], [], [], timeout)[0]:
                return  # nothing read: the stream is still whole
            call_id, status, body = read_frame(self._sock)
        except (OSError, ConnectionError, ValueError) as e:
            self._broken(f"the step channel closed: {e}")
            return
        with self._cond:
            if call_id in self._waiting:
                self._answers[call_id] = (status, body)

    def _broken(self, why: str) -> None:
        """Fail every call in flight: their callers answer UNAVAILABLE."""
        with self._cond:
            if self.alive:
                self.alive, self._why = False, why
                try:
                    self._sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked reading it
                except OSError:
                    pass
                self._sock.close()
            self._cond.notify_all()

    def close(self) -> None:
        self._broken("the client closed the step channel")


def _raising(error: BaseException) -> Callable[[], object]:
    """An answer that is `error`, raised when asked for."""
    def answer():
        raise error
    return answer


def host_of(address: str) -> str | None:
    """The host of a gRPC `host:port` address (None for other targets: unix:, dns:///)."""
    if "/" in address or address.startswith("unix:"):
        return None
    host, sep, port = address.rpartition(":")
    return host.strip("[]") if sep and host and port.isdigit() else None


class StepChannelSlot:
    """A client's step channel to the server at `address`: `offer` (a gRPC answer's
    `step_port`) opens it with `token` in its hello, `client` is it while it is up. One
    that cannot connect, or whose hello is refused, is not tried again for that port
    (logged once); gRPC goes on carrying the steps."""

    def __init__(self, address: str, enabled: bool = True, token: str | None = None):
        self.host = host_of(address) if enabled else None
        self.token = token
        self.client: StepChannelClient | None = None
        self._refused: set[int] = set()
        self._lock = threading.Lock()

    def offer(self, port: int) -> None:
        if not port or self.host is None or port in self._refused:
            return
        with self._lock:
            c = self.client
            if c is not None and c.alive and c.port == port:
                return
            if c is not None:
                c.close()
            try:
                self.client = StepChannelClient(self.host, port, self.token)
            except (OSError, StepChannelError) as e:
                self.client = None
                self._refused.add(port)
                log.warning("step channel %s:%d unreachable or refused (%s): steps go over gRPC",
                            self.host, port, e)

    def call(self, method: str, grpc_call, request, response_type, timeout: float | None):
        """`method` over the channel while it is up and there is no trace context to carry;
        else through `grpc_call` (the stub's method), whose answer may offer the channel."""
        return self.start(method, grpc_call, request, response_type, timeout)()

    def start(self, method: str, grpc_call, request, response_type, timeout: float | None
              ) -> Callable[[], object]:
        """`call`, sent now; the returned function waits for the answer (on the thread that
        calls it) and raises the call's error, a failed send's too. Over gRPC the stub's
        `grpc_call.future` sends it (a plain function is called at once)."""
        metadata = trace_metadata()
        channel = self.get() if metadata is None else None
        try:
            if channel is not None:
                call_id = channel.send(method, request)
                return lambda: channel.answer(call_id, method, response_type, timeout)
            send = getattr(grpc_call, "future", None)
            pending = (send or grpc_call)(request, timeout=timeout, metadata=metadata)
        except grpc.RpcError as e:
            return _raising(e)

        def answer():
            response = pending.result() if send is not None else pending
            self.offer(response.step_port)
            return response
        return answer

    def get(self) -> StepChannelClient | None:
        c = self.client
        return c if c is not None and c.alive else None

    def close(self) -> None:
        with self._lock:
            if self.client is not None:
                self.client.close()
                self.client = None
