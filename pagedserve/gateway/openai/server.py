"""uvicorn serving the OpenAI app (HTTP or HTTPS) inside the gateway's running (uvloop) event loop.

Contract: `start()` binds host:port (OSError if it cannot; port 0 picks a free one), starts
serving as a task of the current loop and returns the bound port. uvicorn installs no
signal handlers here: the gateway's own handlers decide when to stop, and it drains first
(pagedserve.gateway.server.Gateway.drain: new requests get 503 here while the running ones finish or
end with an error event), so `stop()` finds only responses that are ending. `stop()` stops
accepting, gives open requests `grace` seconds, then cancels them (which aborts their
sequences). A client that reads nothing for `write_timeout` seconds while its response
waits is dropped and its request aborted (pagedserve.gateway.openai.write_timeout). Imported only for
--http-port; without uvicorn, importing it raises pagedserve.wire.optional_import.MissingPackage naming
it.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

from pagedserve.gateway.openai.app import HTTP_FEATURE, HTTP_OFF, build_app  # checks starlette and httpx
from pagedserve.gateway.openai.write_timeout import WriteTimeout
from pagedserve.wire.optional_import import require

uvicorn = require("uvicorn", "uvicorn", HTTP_FEATURE, off=HTTP_OFF)

log = logging.getLogger("pagedserve.gateway")
WRITE_TIMEOUT = 30.0  # --http-write-timeout


class _Server(uvicorn.Server):
    def capture_signals(self):
        return contextlib.nullcontext()


class HttpServer:
    def __init__(self, app, host: str = "127.0.0.1", port: int = 8000, grace: float = 2.0,
                 tls_cert: str | None = None, tls_key: str | None = None):
        config = uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False,
                                timeout_graceful_shutdown=grace, ssl_certfile=tls_cert,
                                ssl_keyfile=tls_key)
        self.server = _Server(config)
        self.host = host
        self.port = port
        self._task: asyncio.Task | None = None

    async def start(self) -> int:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.port))
            sock.listen(2048)
        except OSError:
            sock.close()
            raise
        sock.setblocking(False)
        self.port = sock.getsockname()[1]
        self._task = asyncio.create_task(self.server.serve(sockets=[sock]))
        while not self.server.started:
            if self._task.done():
                self._task.result()
                raise RuntimeError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)
        return self.port

    async def stop(self) -> None:
        if self._task is None:
            return
        self.server.should_exit = True
        try:
            await self._task
        except (asyncio.CancelledError, Exception) as e:
            log.info("HTTP server stopped: %s", e or type(e).__name__)


async def start_openai(gateway, host: str, port: int, api_key: str | None = None,
                       grace: float = 2.0, tls=None, write_timeout: float = WRITE_TIMEOUT,
                       **options) -> HttpServer:
    """Serve the OpenAI API of `gateway` (a pagedserve.gateway.server.Gateway) on host:port; HTTPS with
    `tls` (a pagedserve.rpc.tls.TlsConfig with a certificate: the gRPC API's own --tls-cert/--tls-key;
    clients are not asked for certificates); a client that reads nothing for `write_timeout`
    seconds while its response waits is dropped (pagedserve.gateway.openai.write_timeout). `options`
    go to pagedserve.gateway.openai.app.OpenAIApi."""
    cert, key = (tls.cert, tls.key) if tls is not None and tls.cert else (None, None)
    app = WriteTimeout(build_app(gateway, api_key, **options), write_timeout)
    server = HttpServer(app, host, port, grace, cert, key)
    await server.start()
    return server
