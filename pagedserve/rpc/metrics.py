"""Prometheus metrics over HTTP (`GET /metrics`, text format) for any pagedserve service.

Every service takes `--metrics-port` (env PAGEDSERVE_METRICS_PORT): unset means no metrics
listener (the default), 0 picks a free port (logged), N listens on N. The listener binds
the service's own `--host`. Each service keeps its metrics in its own registry (with the
process_* and python_gc_* collectors), so several services can live in one test process.
Names follow vLLM's with the `pagedserve:` prefix (see RELIABILITY.md for the list).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector
from prometheus_client import start_http_server

from pagedserve.wire.settings import setting

# vLLM's buckets for latencies measured in seconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def new_registry(process: bool = True) -> CollectorRegistry:
    """A registry for one service; with `process`, the process and GC collectors too."""
    registry = CollectorRegistry()
    if process:
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        GCCollector(registry=registry)
    return registry


def metrics_port_setting(help: str = "serve Prometheus metrics at http://HOST:PORT/metrics "
                                      "(0 picks a free port)"):
    """The `--metrics-port` field of every service's config."""
    return setting(None, help, metavar="PORT")


def serve_metrics(registry: CollectorRegistry, host: str, port: int | None, log=None):
    """Start the /metrics listener in a daemon thread; return its bound port (None when off)."""
    if port is None or port < 0:
        return None
    server, _thread = start_http_server(port, addr=host, registry=registry)
    bound = server.server_port
    if log is not None:
        log.info("metrics on http://%s:%d/metrics", host, bound)
    return bound
