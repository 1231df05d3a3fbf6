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
- `StepChannelServer` (pagedserve.rpc.step_channel_server) listens on a free port (`port`) and runs each call on a worker
  thread, so a second call on a connection is read while the first one runs; a method
  named in `inline` (memsvc's Reserve, which one lock serializes anyway) runs on the
  connection's own thread, one call after the other, without the handoff. An `abort`
  answers its code and details, any other exception UNKNOWN.
- `StepChannelClient` (pagedserve.rpc.step_channel_client) has no reader thread: the thread that waits for an answer reads.
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

import logging
import socket
import struct
from dataclasses import dataclass

import grpc

from pagedserve.rpc.grpc_service import MAX_MESSAGE_BYTES
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



def read_frame(sock: socket.socket) -> tuple[int, int, bytes]:
    length, call_id, kind = HEADER.unpack(read_exact(sock, HEADER.size))
    if length > MAX_MESSAGE_BYTES:
        raise ConnectionError(f"a {length}-byte frame is over the {MAX_MESSAGE_BYTES}-byte limit")
    return call_id, kind, read_exact(sock, length)


def read_hello(sock: socket.socket) -> tuple[int, bytes]:
    """A hello, or the answer to one: (method or status, body)."""
    length, _, kind = HEADER.unpack(read_exact(sock, HEADER.size))
    if length > MAX_HELLO_BYTES:
        raise ConnectionError(f"a {length}-byte hello is over the {MAX_HELLO_BYTES}-byte limit")
    return kind, read_exact(sock, length)


def read_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionError("the connection closed")
        got += k
    return bytes(buf)


def tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
