"""A plaintext listener for grpc.health.v1 only, beside a service that speaks mutual TLS.

Kubernetes' gRPC probes speak plaintext and present no client certificate, so they cannot
check a listener that requires one. `--health-port PORT` opens a second listener with just
the health service (the same statuses as the main one: SERVING, NOT_SERVING while starting
or draining); it tells nothing but those statuses and accepts no other call. Unset (the
default): no second listener.
"""
from __future__ import annotations

from concurrent import futures

import grpc
from grpc_health.v1 import health_pb2_grpc

from pagedserve.wire.settings import setting


def health_port_setting():
    """The `--health-port` field of memsvc's and the executor's configs."""
    return setting(None, "also serve grpc.health.v1 alone, in plaintext, on this port (for "
                   "Kubernetes probes when the main port requires mutual TLS; 0 picks a free "
                   "one)", metavar="PORT", wiring=True)


def serve_health(health_servicer, host: str, port: int | None, log=None) -> grpc.Server | None:
    """Start the health-only listener (None when `port` is unset); the caller stops it."""
    if port is None or port < 0:
        return None
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if not bound:
        raise OSError(f"cannot listen on {host}:{port} (health)")
    server.start()
    server.bound_port = bound
    if log is not None:
        log.info("health (plaintext, grpc.health.v1 only) on %s:%d", host, bound)
    return server
