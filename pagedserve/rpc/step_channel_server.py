"""The step channel's server: listens beside a service's gRPC server and calls the same
servicer methods for each frame (the contract: pagedserve.rpc.step_channel)."""
from __future__ import annotations

import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc

from pagedserve.rpc.internal_auth import REFUSED, matches
from pagedserve.rpc.step_channel import HEADER, HELLO, HELLO_TIMEOUT_S, METHODS, log, read_frame, read_hello, tune


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
            tune(conn)
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
                call_id, method, payload = read_frame(conn)
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
        method, token = read_hello(conn)
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


def offer_step_channel(config, credentials, handlers: dict, inline: tuple[str, ...] = (),
                       token: str | None = None) -> StepChannelServer | None:
    """A step channel beside a service's gRPC server on `config.host`, when
    `config.step_channel` offers one and the server is plaintext (`credentials` None);
    with `token`, it takes only the connections whose hello carries it."""
    if not config.step_channel.enabled or credentials is not None:
        return None
    return StepChannelServer(config.host, handlers, inline=inline, token=token)
