"""`pagedserve serve [MODEL]`: memsvc, executor and gateway as local processes, from one
command line. A hub id MODEL is resolved (downloaded) once, before the children start
(`pin_model`; pagedserve.executor.model_source).

Its flags are the services' own (pagedserve.memsvc.config, pagedserve.executor.config, pagedserve.gateway.config), grouped
by service, each declared once; `serve` chooses only the wiring (hosts, ports, peer
addresses) and, unless given one (or `--insecure-internal`), a fresh internal token per
launch (pagedserve.rpc.internal_auth) that every child gets. A child gets its whole config as flags
(`to_argv`), secrets (the token, the API key) by environment.

On SIGTERM or Ctrl-C the gateways drain first (`--drain-timeout`: NOT_SERVING, nothing new
admitted, the running requests of both APIs finish), and only once they have exited are
the executors stopped, then memsvc (pagedserve.supervisor's stop waves). The executors get
`--drain-timeout 0`: when they are told to stop no gateway is left to drain for.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from dataclasses import dataclass

from pagedserve.executor.config import ExecutorConfig
from pagedserve.gateway.config import GATEWAY_PORT, STOP_AFTER_DRAIN_S, GatewayConfig
from pagedserve.memsvc.config import MemsvcConfig
from pagedserve.rpc.internal_auth import new_token
from pagedserve.rpc.ports import free_port, reserve
from pagedserve.rpc.tls import TlsConfig
from pagedserve.rpc.tracing import TracingConfig
from pagedserve.wire.settings import add_flags, from_args, secret_env, setting, to_argv

GENERATION = "pagedserve.v1.Generation"


@dataclass
class ServeConfig:
    """What only `serve` decides: where the gateways listen, how many of each service."""

    port: int = setting(GATEWAY_PORT, "the first gateway's gRPC port; gateway i listens on "
                        "--port + i", env="GATEWAY_PORT")
    memsvc_port: int = setting(0, "memsvc's port (0: a free one; replicas > 1 always pick "
                               "free ones)")
    executor_port: int = setting(0, "the executor's port (0: a free one)")
    replicas: int = setting(1, "executor replicas (memsvc + executor pairs, each with its own "
                            "pool) behind every gateway", metavar="R", env="SERVE_REPLICAS")
    gateways: int = setting(1, "gateways sharing the replicas; only the first serves the HTTP "
                            "API and --metrics-port", metavar="G", env="SERVE_GATEWAYS")

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.gateways < 1:
            raise ValueError("--replicas and --gateways must be >= 1")


SERVICE_GROUPS = [("memsvc", MemsvcConfig), ("executor", ExecutorConfig), ("gateway", GatewayConfig)]


def add_parsers(sub) -> None:
    p = sub.add_parser("serve", help="serve a model: memsvc, executor and gateway on this host",
                       description="Serve MODEL (a Hugging Face hub id, a model directory or a "
                                   ".gguf file; none: the built-in default): start memsvc, the "
                                   "executor and the gateway as processes on "
                                   "127.0.0.1; restart any that crashes. On SIGTERM or Ctrl-C the "
                                   "gateway drains (--drain-timeout), then the executor and memsvc "
                                   "stop. Every flag of every service works here.")
    add_serve_flags(p)
    p.set_defaults(run=run_serve)


def add_serve_flags(p: argparse.ArgumentParser) -> None:
    seen: set[str] = set()
    group = p.add_argument_group("serve")
    add_flags(group, ServeConfig, seen=seen)
    add_flags(group, GatewayConfig, only={"drain_timeout"}, seen=seen)  # the gateways drain
    common = p.add_argument_group("every service: the token and TLS between them, tracing, metrics")
    add_flags(common, MemsvcConfig, only={"internal_token", "insecure_internal"}, seen=seen)
    add_flags(common, TlsConfig, seen=seen)
    add_flags(common, TracingConfig, seen=seen)
    add_flags(common, GatewayConfig, only={"metrics_port"}, seen=seen)
    for name, cls in SERVICE_GROUPS:
        add_flags(p.add_argument_group(name), cls, skip_wiring=True, seen=seen)


def suffix(i: int) -> str:
    """Names of the i-th replica's or gateway's services: memsvc, memsvc-1, ..."""
    return f"-{i}" if i else ""


def service_specs(args, host: str = "127.0.0.1"):
    """The services of `serve`, in start order: memsvc and executor per replica, then gateways.
    Raises ValueError for settings that cannot work."""
    from pagedserve.supervisor import ServiceSpec

    serve = from_args(ServeConfig, args)
    memsvc = from_args(MemsvcConfig, args, host=host)
    executor = from_args(ExecutorConfig, args, host=host)
    gateway = from_args(GatewayConfig, args, host=host)
    if not memsvc.internal_token and not memsvc.insecure_internal:  # closed: a token per launch
        token = new_token()
        memsvc, executor, gateway = (dataclasses.replace(c, internal_token=token)
                                     for c in (memsvc, executor, gateway))
    reserve(*range(serve.port, serve.port + serve.gateways), serve.memsvc_port, serve.executor_port,
            gateway.http_port, gateway.metrics_port or 0)
    metrics_elsewhere = None if gateway.metrics_port is None else 0
    # the first gateway's HTTP /metrics includes every replica's memsvc and executor, so
    # they always get a (free) metrics port the gateway is told about
    scrape = bool(gateway.http_port)
    cli = [sys.executable, "-m", "pagedserve.cli"]
    specs, pairs, upstreams = [], [], []
    for i in range(serve.replicas):
        scaled = serve.replicas > 1
        m = dataclasses.replace(memsvc, port=(0 if scaled else serve.memsvc_port) or free_port(host),
                                metrics_port=free_port(host) if scrape else metrics_elsewhere)
        e = dataclasses.replace(executor, port=(0 if scaled else serve.executor_port) or free_port(host),
                                memsvc=f"{host}:{m.port}", drain_timeout=0.0,
                                metrics_port=free_port(host) if scrape else metrics_elsewhere)
        if scrape:
            upstreams += [f"memsvc{suffix(i)}=http://{host}:{m.metrics_port}/metrics",
                          f"executor{suffix(i)}=http://{host}:{e.metrics_port}/metrics"]
        specs.append(ServiceSpec(f"memsvc{suffix(i)}", cli + ["memsvc", *to_argv(m)], f"{host}:{m.port}",
                                 restart_with=[f"executor{suffix(i)}"], tls=_client_tls(memsvc.tls),
                                 shm_patterns=["/dev/shm/pagedserve-kv-{pid}-*"], stop_wave=2,
                                 env=secret_env(m)))
        specs.append(ServiceSpec(f"executor{suffix(i)}", cli + ["executor", *to_argv(e)],
                                 f"{host}:{e.port}", tls=_client_tls(executor.tls), stop_wave=1,
                                 env=secret_env(e)))
        pairs.append((m, e))
    for i in range(serve.gateways):
        g = dataclasses.replace(gateway, port=serve.port + i,
                                http_port=gateway.http_port if i == 0 else 0,
                                metrics_port=gateway.metrics_port if i == 0 else metrics_elsewhere,
                                metrics_upstream=upstreams if i == 0 else [])
        if serve.replicas > 1 or serve.gateways > 1:
            g = dataclasses.replace(g, replica=[f"{host}:{m.port},{host}:{e.port}" for m, e in pairs])
        else:
            g = dataclasses.replace(g, memsvc=f"{host}:{pairs[0][0].port}",
                                    executor=f"{host}:{pairs[0][1].port}")
        specs.append(ServiceSpec(f"gateway{suffix(i)}", cli + ["gateway", *to_argv(g)],
                                 f"{host}:{g.port}", health_service=GENERATION, env=secret_env(g),
                                 tls=_client_tls(gateway.tls), stop_wave=0,
                                 stop_grace=g.drain_timeout + STOP_AFTER_DRAIN_S))
    return specs


def _client_tls(tls: TlsConfig) -> TlsConfig | None:
    """How `serve` itself calls a child that listens with `tls`: TLS only when it has a cert."""
    return tls if tls.cert else None


def list_models(address: str, api_key: str | None, tls: TlsConfig | None = None) -> str:
    """The name of the model the gateway serves (with the API key when one is set)."""
    from pagedserve.rpc.grpc_service import open_channel
    from pagedserve.wire.v1 import generation_pb2, generation_pb2_grpc

    metadata = [("authorization", f"Bearer {api_key}")] if api_key else None
    with open_channel(address, tls) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        return stub.ListModels(generation_pb2.ListModelsRequest(), timeout=10, metadata=metadata).models[0].name


def pin_model(args) -> None:
    """Resolve a hub id MODEL here, before any child starts: downloaded once, in the
    foreground with its progress bars, then every executor (replicas, restarts) loads its
    snapshot directory under the hub id's name, without the network. A path that does not
    exist fails here too. Raises ModelLoadError (what was tried, what to do)."""
    config = from_args(ExecutorConfig, args)
    if config.model is None or config.model_free or os.path.exists(os.path.expanduser(config.model)):
        return
    from pagedserve.executor.model_source import resolve_model, served_name

    path = resolve_model(config.model, config.revision)
    args.served_model_name = config.served_model_name or [served_name(config.model, path)]
    args.model, args.revision = path, None


def run_serve(args) -> int:
    from pagedserve.executor.errors import ModelLoadError
    from pagedserve.supervisor import ServiceFailed, Supervisor

    try:
        pin_model(args)
        specs = service_specs(args)
        gateway = from_args(GatewayConfig, args)
    except (ValueError, ModelLoadError) as e:
        print(f"pagedserve serve: {e}", file=sys.stderr)
        return 2
    sup = Supervisor(specs)
    sup.install_signal_handlers()
    try:
        sup.start()
        if not sup.stopping:
            first = sup.by_name["gateway"].spec
            name = list_models(first.address, gateway.api_key, first.tls)
            gateways = [r.spec.address for r in sup.services if r.spec.name.startswith("gateway")]
            replicas = args.replicas
            print(f"pagedserve: serving {name} on {' '.join(gateways)}"
                  + (f" ({replicas} replicas, {gateway.routing} routing)" if replicas > 1 else ""),
                  flush=True)
            if gateway.http_port:
                url = f"{'https' if gateway.tls.cert else 'http'}://{gateway.http_host}:{gateway.http_port}"
                print(f"pagedserve: OpenAI-compatible API on {url}/v1, metrics on {url}/metrics",
                      flush=True)
            sup.run()
    except ServiceFailed as e:
        sup.log(str(e))
        return 1
    finally:
        sup.stop()
    return 0
