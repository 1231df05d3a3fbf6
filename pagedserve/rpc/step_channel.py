"""The step channel: the two calls a step makes (Reserve, Execute) as frames on one TCP
connection per client, beside the gRPC server that offers it (docs/ARCHITECTURE.md, "The
step path").

Why: a unary gRPC call costs ~0.17 ms of client and ~0.26 ms of server CPU in grpcio's
Python stack (bare, 6 KB, Intel Xeon); a frame on a socket ~0.05 and ~0.04. The messages
are the same protobufs, and the server calls the same servicer method with a context that
answers `abort` and `peer`.

Contract:
- A frame is `<u32 length><u32 call id><u8 method or status>` and `length` bytes: the
  serialized request, or in an answer the serialized response (status 0) or the error's
  details (a grpc.StatusCode's number).
- A connection opens with a hello: the client's first frame is method HELLO (0) carrying
  the internal token (pagedserve.rpc.internal_auth; empty without one), answered before any call is
  read: status 0, or UNAUTHENTICATED and the connection closed when the server has a token
  and this is not it (a first frame that is no hello, or none in HELLO_TIMEOUT_S, is
  refused alike). Checked once per connection, not per frame.
- `StepChannelServer` listens on a free port (`port`) and runs each call on a worker
  thread, so a second call on a connection is read while the first one runs; a method
  named in `inline` (memsvc's Reserve, which one lock serializes anyway) runs on the
  connection's own thread, one call after the other, without the handoff. An `abort`
  answers its code and details, any other exception UNKNOWN.
- `StepChannelClient` has no reader thread: the thread that waits for an answer reads.
- The gRPC servicer says `step_port` in its Reserve/Execute answers when it offers one
  (only without TLS: the channel is plaintext, as plaintext gRPC is; the hello's token
  authenticates it as the token's metadata does a gRPC call).
  `StepChannelSlot` holds a client's connection, opened when an answer names a port; a
  call with trace context goes over gRPC, which carries it.
- A failed call raises StepChannelError, a grpc.RpcError with `code()` and `details()`,
  so the callers' retries read it as a gRPC failure; a broken connection fails every call
  in flight with UNAVAILABLE and is dropped: the next call goes over gRPC again.
"""
from __future__ import annotations

import itertools
import logging
import select
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import grpc

from pagedserve.rpc.grpc_service import MAX_MESSAGE_BYTES
from pagedserve.rpc.internal_auth import REFUSED, matches
from pagedserve.rpc.tracing import trace_metadata
from pagedserve.wire.settings import setting

HEADER = struct.Struct("<IIB")
HELLO = 0
METHODS = {"Reserve": 1, "Execute": 2}
CODES = {c.value[0]: c for c in grpc.StatusCode}
CONNECT_TIMEOUT_S = 2.0
HELLO_TIMEOUT_S = 10.0
MAX_HELLO_BYTES = 4096
log = logging.getLogger("pagedserve.step_channel")


@dataclass
class StepChannelConfig:
    enabled: bool = setting(True, "offer the step channel: Reserve and Execute as frames on a plain "
                            "TCP connection beside gRPC (pagedserve.rpc.step_channel; never with TLS)",
                            name="step_channel")


class StepChannelError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.status, self.details = code, details


class _Context:
    """What the servicer methods use of a grpc.ServicerContext."""

    def __init__(self, peer: str):
        self._peer = peer

    def abort(self, code: grpc.StatusCode, details: str):
        raise _Abort(code, details)

    def peer(self) -> str:
        return self._peer

    def is_active(self) -> bool:
        return True

    def invocation_metadata(self):
        return ()


def _read_frame(sock: socket.socket) -> tuple[int, int, bytes]:
    length, call_id, kind = HEADER.unpack(_read_exact(sock, HEADER.size))
    if length > MAX_MESSAGE_BYTES:
        raise ConnectionError(f"a {length}-byte frame is over the {MAX_MESSAGE_BYTES}-byte limit")
    return call_id, kind, _read_exact(sock, length)


def _read_hello(sock: socket.socket) -> tuple[int, bytes]:
    """A hello, or the answer to one: (method or status, body)."""
    length, _, kind = HEADER.unpack(_read_exact(sock, HEADER.size))
    if length > MAX_HELLO_BYTES:
        raise ConnectionError(f"a {length}-byte hello is over the {MAX_HELLO_BYTES}-byte limit")
    return kind, _read_exact(sock, length)


def _read_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionError("the connection closed")
        got += k
    return bytes(buf)


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class StepChannelServer:
    """Serves `handlers` (method name -> (servicer method, request message class))."""

    def __init__(self, host: str, handlers: dict, workers: int = 8, inline: tuple[str, ...] = (),
                 token: str | None = None):
        self.handlers = {METHODS[name]: h for name, h in handlers.items()}
        self._token = token
        self._inline = {METHODS[name] for name in inline}
        host = host.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, 0), family=family)
        self.port = self._listener.getsockname()[1]
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="step-channel")
        self._conns: set[socket.socket] = set()
        self._closed = False
        threading.Thread(target=self._accept, name="step-channel-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, addr = self._listener.accept()
            except OSError:
                return
            _tune(conn)
            self._conns.add(conn)
            peer = f"step-channel:{addr[0]}:{addr[1]}"
            threading.Thread(target=self._serve, args=(conn, peer), name="step-channel-conn",
                             daemon=True).start()

    def _serve(self, conn: socket.socket, peer: str) -> None:
        write = threading.Lock()
        try:
            if not self._hello(conn):
                return
            while True:
                call_id, method, payload = _read_frame(conn)
                if method in self._inline:
                    self._call(conn, write, peer, call_id, method, payload)
                else:
                    self._pool.submit(self._call, conn, write, peer, call_id, method, payload)
        except (OSError, ConnectionError, RuntimeError):  # closed, or the pool shut down
            pass
        finally:
            self._conns.discard(conn)
            conn.close()

    def _hello(self, conn: socket.socket) -> bool:
        """Read the connection's hello and answer it; False: refused (answered, to be closed)."""
        conn.settimeout(HELLO_TIMEOUT_S)
        method, token = _read_hello(conn)
        conn.settimeout(None)
        if method == HELLO and (not self._token or matches(self._token, token)):
            conn.sendall(HEADER.pack(0, 0, 0))
            return True
        why = REFUSED if method == HELLO else "the step channel opens with a hello frame"
        body = why.encode()
        conn.sendall(HEADER.pack(len(body), 0, grpc.StatusCode.UNAUTHENTICATED.value[0]) + body)
        return False

    def _call(self, conn, write, peer, call_id, method, payload) -> None:
        try:
            handler = self.handlers.get(method)
            if handler is None:
                raise _Abort(grpc.StatusCode.UNIMPLEMENTED, f"no method {method} on this step channel")
            fn, request_type = handler
            status, body = 0, fn(request_type.FromString(payload), _Context(peer)).SerializeToString()
        except _Abort as e:
            status, body = e.status.value[0], e.details.encode()
        except Exception as e:  # noqa: BLE001 - the caller gets it as UNKNOWN, as over gRPC
            log.exception("step channel call failed")
            status, body = grpc.StatusCode.UNKNOWN.value[0], f"{type(e).__name__}: {e}".encode()
        try:
            with write:
                conn.sendall(HEADER.pack(len(body), call_id, status) + body)
        except OSError:
            pass  # the client went away

    def close(self) -> None:
        self._closed = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() that holds it open
        except OSError:
            pass
        self._listener.close()
        for conn in list(self._conns):
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._pool.shutdown(wait=False, cancel_futures=True)


class StepChannelClient:
    """Calls on one connection. `send` writes a call's frame and returns its id; `answer`
    reads the answers on the thread that waits for one (no reader thread, so no handoff
    between threads per call): answers to other calls are kept for their callers, and
    one thread reads at a time while the others wait for it."""

    def __init__(self, host: str, port: int, token: str | None = None):
        self.port = port
        self._sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
        try:
            _tune(self._sock)
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
        status, details = _read_hello(self._sock)
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
            call_id, status, body = _read_frame(self._sock)
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


def offer_step_channel(config, credentials, handlers: dict, inline: tuple[str, ...] = (),
                       token: str | None = None) -> StepChannelServer | None:
    """A step channel beside a service's gRPC server on `config.host`, when
    `config.step_channel` offers one and the server is plaintext (`credentials` None);
    with `token`, it takes only the connections whose hello carries it."""
    if not config.step_channel.enabled or credentials is not None:
        return None
    return StepChannelServer(config.host, handlers, inline=inline, token=token)


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
