"""Optional packages are imported when their feature is asked for (pagedserve.wire.optional_import):
without opentelemetry-sdk, grpcio-reflection, starlette, httpx or uvicorn a service still
imports and runs while the feature is off, and asking for it raises MissingPackage naming
the package. A missing package is simulated by None in sys.modules (every loaded submodule
too), and the module under test is imported afresh; monkeypatch restores both."""
import importlib
import logging
import sys

import pytest

from pagedserve.wire.optional_import import MissingPackage, available, require


@pytest.fixture
def missing(monkeypatch):
    """missing(*packages): those packages cannot be imported for the rest of the test."""
    def hide(*names):
        for name in names:
            for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
                monkeypatch.setitem(sys.modules, key, None)
            monkeypatch.setitem(sys.modules, name, None)
    return hide


@pytest.fixture
def fresh(monkeypatch):
    """fresh(module): `module` imported again now (its old object is put back afterwards)."""
    def load(name):
        parent, _, child = name.rpartition(".")
        if name in sys.modules:
            monkeypatch.setitem(sys.modules, name, sys.modules[name])
            del sys.modules[name]
        if parent and hasattr(sys.modules.get(parent), child):
            monkeypatch.setattr(sys.modules[parent], child, getattr(sys.modules[parent], child))
        return importlib.import_module(name)
    return load


@pytest.fixture
def no_tracing_env(monkeypatch):
    for key in ("OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT",
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "PAGEDSERVE_TRACE_FILE"):
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


def test_require_names_the_package_the_feature_and_the_way_off(missing):
    missing("starlette")
    with pytest.raises(MissingPackage) as e:
        require("starlette.routing", "starlette", "the HTTP API (--http-port)", off="--http-port 0")
    assert isinstance(e.value, ImportError) and e.value.name == "starlette.routing"
    assert str(e.value).startswith("the HTTP API (--http-port) needs the Python package 'starlette'")
    assert str(e.value).endswith("pip install starlette, or --http-port 0")
    assert not available("starlette.routing") and available("json")
    assert require("json", "json", "x").dumps([]) == "[]"


def test_tracing_off_needs_no_sdk(missing, fresh, no_tracing_env):
    missing("opentelemetry.sdk", "opentelemetry.exporter")
    tracing = fresh("pagedserve.rpc.tracing")
    assert tracing._exporters("memsvc") == [] and tracing.setup_tracing("memsvc") is None
    assert tracing.trace_metadata() is None  # propagation is the API's: still there
    assert tracing.ServerTracing() is not None


@pytest.mark.parametrize("env, package", [
    ({"PAGEDSERVE_TRACE_FILE": "spans.jsonl"}, "opentelemetry-sdk"),
    ({"OTEL_TRACES_EXPORTER": "console"}, "opentelemetry-sdk"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}, "opentelemetry-exporter-otlp-proto-grpc"),
])
def test_tracing_asked_for_without_its_package_names_it(missing, fresh, no_tracing_env, env, package):
    missing("opentelemetry.sdk", "opentelemetry.exporter")
    tracing = fresh("pagedserve.rpc.tracing")
    for key, value in env.items():
        no_tracing_env.setenv(key, value)
    with pytest.raises(MissingPackage, match=f"needs the Python package '{package}'.*pip install {package}"):
        tracing.setup_tracing("gateway")


def test_trace_file_exporter_is_made_from_the_sdk_when_asked(tmp_path, no_tracing_env):
    from pagedserve.rpc import tracing

    no_tracing_env.setenv("PAGEDSERVE_TRACE_FILE", str(tmp_path / "{service}.jsonl"))
    [(exporter, batched)] = tracing._exporters("executor")
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    assert isinstance(exporter, SpanExporter) and type(exporter).__name__ == "JsonLinesExporter"
    assert exporter.path == str(tmp_path / "executor.jsonl") and not batched
    assert exporter.export([]) == SpanExportResult.SUCCESS


def test_a_service_runs_without_reflection_and_says_so(missing, fresh, caplog):
    missing("grpc_reflection")
    grpc_service = fresh("pagedserve.rpc.grpc_service")
    with caplog.at_level(logging.WARNING, logger="pagedserve"):
        service = grpc_service.Service(["pagedserve.v1.Test"])
    try:
        assert "grpcio-reflection is not installed" in caplog.text
        service.set_serving(True)
        from grpc_health.v1 import health_pb2

        reply = service.health.Check(health_pb2.HealthCheckRequest(service="pagedserve.v1.Test"), None)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        service.server.stop(0)


def test_clients_need_no_health_package_and_a_service_names_it(missing, fresh):
    missing("grpc_health")
    grpc_service = fresh("pagedserve.rpc.grpc_service")
    grpc_service.open_channel("127.0.0.1:1").close()
    with pytest.raises(MissingPackage, match="grpcio-health-checking"):
        grpc_service.Service(["pagedserve.v1.Test"])


def test_the_gateway_without_http_packages_imports_and_http_names_them(missing, fresh, monkeypatch):
    missing("starlette", "uvicorn", "httpx")
    for name in ("pagedserve.gateway.openai.server", "pagedserve.gateway.openai.app"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    fresh("pagedserve.gateway.main")  # the gateway's process: no HTTP module at import
    with pytest.raises(MissingPackage, match="'starlette'.*--http-port 0 to turn it off"):
        fresh("pagedserve.gateway.openai.app")


def test_http_without_uvicorn_names_it(missing, fresh):
    missing("uvicorn")
    with pytest.raises(MissingPackage, match="'uvicorn'.*pip install uvicorn, or --http-port 0"):
        fresh("pagedserve.gateway.openai.server")
