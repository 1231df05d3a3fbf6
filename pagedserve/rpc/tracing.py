"""OpenTelemetry traces for the three services, with W3C trace context in gRPC metadata.

`setup_tracing(service, config)` configures this process once, from its TracingConfig
(`--otlp-endpoint`, `--trace-file`) and the environment:
- OTLP over gRPC when OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is
  set (the exporter reads the other OTEL_EXPORTER_OTLP_* variables itself);
- OTEL_TRACES_EXPORTER=console: spans printed to stdout;
- PAGEDSERVE_TRACE_FILE=PATH: each span appended to PATH as one JSON object per line
  (`{service}` in PATH becomes gateway, memsvc or executor: one file per service);
- otherwise nothing is recorded (the default), though trace context still passes through.
OTEL_SDK_DISABLED=true or OTEL_TRACES_EXPORTER=none turns it off. The resource is named by
OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES, else `pagedserve-<service>`.

Packages: opentelemetry-api (trace context and spans, no-ops while nothing records) is
imported with this module; opentelemetry-sdk, and opentelemetry-exporter-otlp-proto-grpc for
OTLP, only by `setup_tracing` when an exporter is asked for, so a service runs without them
while tracing is off; asking without them is pagedserve.wire.optional_import.MissingPackage, naming the
package.

Propagation: a client passes `trace_metadata()` (`traceparent`/`tracestate` of the current
span) as the metadata of each call; `ServerTracing` (a sync server
interceptor) opens a SERVER span for each unary call that arrived with a `traceparent`,
as a child of the caller's span, and makes it current for the handler. Calls without
trace context (health probes, heartbeats) get no span.
"""
from __future__ import annotations

import atexit
import os
import threading
from dataclasses import dataclass

import grpc
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from pagedserve.wire.optional_import import require
from pagedserve.wire.settings import setting

TRACE_FILE_ENV = "PAGEDSERVE_TRACE_FILE"
_provider = None  # the SDK's TracerProvider once setup_tracing installed one
_json_lines_class = None


_OFF = "leave --otlp-endpoint, --trace-file and OTEL_TRACES_EXPORTER unset"


def json_lines_exporter(path: str):
    """A SpanExporter appending each finished span to `path` as one line of JSON
    (ReadableSpan.to_json); its class is made from the SDK's on first use."""
    global _json_lines_class
    if _json_lines_class is None:
        export = require("opentelemetry.sdk.trace.export", "opentelemetry-sdk",
                         f"tracing ({TRACE_FILE_ENV} / --trace-file)", off=_OFF)

        class JsonLinesExporter(export.SpanExporter):
            def __init__(self, path: str):
                self.path = path
                self._lock = threading.Lock()

            def export(self, spans):
                lines = "".join(s.to_json(indent=None) + "\n" for s in spans)
                with self._lock, open(self.path, "a", encoding="utf-8") as f:
                    f.write(lines)
                return export.SpanExportResult.SUCCESS

        _json_lines_class = JsonLinesExporter
    return _json_lines_class(path)


@dataclass
class TracingConfig:
    """Where a service sends its spans; both off by default (trace context still passes)."""

    otlp_endpoint: str | None = setting(None, "send spans by OTLP/gRPC to this endpoint "
                                        "(also OTEL_EXPORTER_OTLP_ENDPOINT)", metavar="URL")
    trace_file: str | None = setting(None, "append spans as JSON lines to PATH; {service} in "
                                     "PATH becomes the service's name", metavar="PATH")


def _exporters(service: str = "", config: TracingConfig | None = None) -> list[tuple[object, bool]]:
    """(exporter, batched) pairs the config and the environment ask for."""
    env = dict(os.environ)
    if config is not None and config.otlp_endpoint:
        env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = config.otlp_endpoint
    if config is not None and config.trace_file:
        env[TRACE_FILE_ENV] = config.trace_file
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    kinds = {k.strip().lower() for k in env.get("OTEL_TRACES_EXPORTER", "").split(",") if k.strip()}
    if "none" in kinds:
        return []
    out: list[tuple[object, bool]] = []
    if "otlp" in kinds or env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        otlp = require("opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
                       "opentelemetry-exporter-otlp-proto-grpc", "tracing (OTLP, --otlp-endpoint)", off=_OFF)
        endpoint = config.otlp_endpoint if config is not None else None
        out.append((otlp.OTLPSpanExporter(endpoint=endpoint) if endpoint else otlp.OTLPSpanExporter(), True))
    if "console" in kinds:
        export = require("opentelemetry.sdk.trace.export", "opentelemetry-sdk",
                         "tracing (OTEL_TRACES_EXPORTER=console)", off=_OFF)
        out.append((export.ConsoleSpanExporter(), False))
    if env.get(TRACE_FILE_ENV):
        out.append((json_lines_exporter(env[TRACE_FILE_ENV].replace("{service}", service)), False))
    return out


def setup_tracing(service: str, config: TracingConfig | None = None):
    """Install an SDK TracerProvider for `service` if the environment asks for an exporter.

    Returns it (None when tracing is off: the SDK is then not imported). Spans are flushed by `shutdown_tracing`, which
    also runs at exit.
    """
    global _provider
    if _provider is not None:
        return _provider
    exporters = _exporters(service, config)
    if not exporters:
        return None
    resources = require("opentelemetry.sdk.resources", "opentelemetry-sdk", "tracing", off=_OFF)
    sdk_trace = require("opentelemetry.sdk.trace", "opentelemetry-sdk", "tracing", off=_OFF)
    export = require("opentelemetry.sdk.trace.export", "opentelemetry-sdk", "tracing", off=_OFF)
    attrs = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": f"pagedserve-{service}"}
    provider = sdk_trace.TracerProvider(resource=resources.Resource.create(attrs))
    for exporter, batched in exporters:
        processor = export.BatchSpanProcessor if batched else export.SimpleSpanProcessor
        provider.add_span_processor(processor(exporter))
    trace.set_tracer_provider(provider)
    _provider = provider
    atexit.register(shutdown_tracing)
    return provider


def shutdown_tracing() -> None:
    """Flush and stop the exporters (safe to call twice)."""
    global _provider
    if _provider is not None:
        provider, _provider = _provider, None
        provider.shutdown()


def tracer() -> trace.Tracer:
    return trace.get_tracer("pagedserve")


def extract_context(metadata):
    """The OpenTelemetry context carried by gRPC metadata (pairs of key, value)."""
    return propagate.extract({k: v for k, v in (metadata or ()) if isinstance(v, str)})


def has_trace_context(metadata) -> bool:
    return any(k == "traceparent" for k, _ in (metadata or ()))


def trace_metadata() -> tuple[tuple[str, str], ...] | None:
    """The current trace context as gRPC metadata for one call (`metadata=`), None when there
    is none. Passed per call rather than by a client interceptor, which cost ~0.1 ms per call
    on a 2-CPU machine even with nothing to add."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return tuple(carrier.items()) or None


class ServerTracing(grpc.ServerInterceptor):
    """A SERVER span around each unary call that carries a traceparent (see module doc)."""

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if (handler is None or handler.unary_unary is None or details.method.startswith("/grpc.")
                or not has_trace_context(details.invocation_metadata)):
            return handler
        parent = extract_context(details.invocation_metadata)
        inner = handler.unary_unary
        service, _, method = details.method.lstrip("/").partition("/")

        def traced(request, context):
            with tracer().start_as_current_span(
                    f"{service}/{method}", context=parent, kind=SpanKind.SERVER,
                    attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": method},
                    record_exception=False, set_status_on_exception=False) as span:
                try:
                    return inner(request, context)
                except BaseException:
                    code = context.code() if hasattr(context, "code") else None
                    span.set_status(Status(StatusCode.ERROR, str(code or "exception")))
                    raise

        return grpc.unary_unary_rpc_method_handler(
            traced, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)
