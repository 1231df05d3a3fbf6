"""What every internal pagedserve gRPC service shares: message limits, health and reflection,
server-side trace context, optional TLS, client channels, flag defaults from the
environment, and running until SIGTERM/SIGINT.

Packages: grpcio-health-checking and grpcio-reflection are imported by `Service`, not with
this module, so clients (open_channel, get_logger) need neither. Health is how every caller
knows a service is ready: a Service without grpcio-health-checking raises
pagedserve.wire.optional_import.MissingPackage naming it. Reflection (grpcurl's service listing) is on
where grpcio-reflection is installed; without it the service runs and logs that it is off."""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from concurrent import futures

import grpc

from pagedserve.rpc.internal_auth import with_token
from pagedserve.wire.optional_import import available, require

MAX_MESSAGE_BYTES = 64 << 20
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
# Clients reconnect quickly to a restarted service (gRPC's default backoff grows to 120 s).
CLIENT_OPTIONS = GRPC_OPTIONS + [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def env_default(name: str, default, kind=str):
    """`PAGEDSERVE_<name>` from the environment (converted with `kind`), else `default`."""
    value = os.environ.get(f"PAGEDSERVE_{name}")
    if value is None or value == "":
        return default
    if kind is bool:
        return value.strip().lower() in ("1", "true", "yes", "on")
    return kind(value)


def get_logger(service: str) -> logging.Logger:
    log = logging.getLogger(f"pagedserve.{service}")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"{service}: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    return log


def open_channel(address: str, tls=None, token: str | None = None) -> grpc.Channel:
    """A client channel to a pagedserve service: TLS when `tls` (pagedserve.rpc.tls.TlsConfig)
    asks for it, the internal token in every call when `token` is set
    (pagedserve.rpc.internal_auth), and quick reconnects. (Trace context: pagedserve.rpc.tracing.trace_metadata.)"""
    options = CLIENT_OPTIONS + (tls.channel_options() if tls is not None else [])
    credentials = tls.channel_credentials() if tls is not None else None
    if credentials is not None:
        channel = grpc.secure_channel(address, credentials, options=options)
    else:
        channel = grpc.insecure_channel(address, options=options)
    return with_token(channel, token)


class Service:
    """A sync gRPC server with grpc.health.v1 (NOT_SERVING until `set_serving`), reflection,
    a SERVER span for each call that carries trace context (pagedserve.rpc.tracing), and before that
    `interceptors` (pagedserve.rpc.peer_auth)."""

    def __init__(self, service_names: list[str], max_workers: int = 8,
                 interceptors: list[grpc.ServerInterceptor] = ()):
        from pagedserve.rpc.tracing import ServerTracing

        feature = "a pagedserve service's grpc.health.v1 (how callers know it is ready)"
        health = require("grpc_health.v1.health", "grpcio-health-checking", feature)
        health_pb2_grpc = require("grpc_health.v1.health_pb2_grpc", "grpcio-health-checking", feature)
        self._statuses = require("grpc_health.v1.health_pb2", "grpcio-health-checking", feature).HealthCheckResponse
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers),
                                  options=GRPC_OPTIONS,
                                  interceptors=[*interceptors, ServerTracing()])
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = list(service_names)
        if available("grpc_reflection.v1alpha.reflection"):
            from grpc_reflection.v1alpha import reflection

            reflection.enable_server_reflection(
                [*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server)
        else:
            logging.getLogger("pagedserve").warning(
                "gRPC reflection off: grpcio-reflection is not installed (pip install grpcio-reflection)")
        self.set_serving(False)
        self.port = 0

    def set_serving(self, serving: bool) -> None:
        status = self._statuses.SERVING if serving else self._statuses.NOT_SERVING
        for name in ("", *self.service_names):
            self.health.set(name, status)

    def start(self, host: str, port: int, credentials: grpc.ServerCredentials | None = None) -> str:
        """Bind (TLS with `credentials`) and start; return the address actually bound (port 0
        picks a free one)."""
        if credentials is not None:
            self.port = self.server.add_secure_port(f"{host}:{port}", credentials)
        else:
            self.port = self.server.add_insecure_port(f"{host}:{port}")
        if not self.port:
            raise OSError(f"cannot listen on {host}:{port}")
        self.server.start()
        return f"{host}:{self.port}"

    def stop(self, grace: float = 2.0) -> None:
        self.set_serving(False)
        self.server.stop(grace).wait()


def stop_on_signals() -> threading.Event:
    """An event set by SIGTERM or SIGINT from now on (call from the main thread)."""
    stop = threading.Event()

    def handler(signum, _frame):
        stop.set()

    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, handler)
    return stop


def wait(stop: threading.Event) -> None:
    """Block the main thread until `stop` is set (signal handlers still run)."""
    while not stop.wait(0.5):
        pass
