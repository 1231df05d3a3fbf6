"""`pagedserve gateway`: the public Generation service in front of a remote memsvc and executor."""
from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from gateway.scheduler import SchedulerConfig
from gateway.server import SERVING, Backend, Gateway
from wire.grpc_service import env_default as _env
from wire.grpc_service import get_logger, open_channel
from wire.metrics import add_metrics_argument
from wire.tls import add_tls_arguments, tls_from_args


def add_gateway_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default=_env("GATEWAY_HOST", "127.0.0.1"),
                   help="address to listen on (env PAGEDSERVE_GATEWAY_HOST; default 127.0.0.1)")
    p.add_argument("--port", type=int, default=_env("GATEWAY_PORT", 50051, int),
                   help="port to listen on (env PAGEDSERVE_GATEWAY_PORT; default 50051)")
    p.add_argument("--memsvc", default=_env("MEMSVC", "127.0.0.1:50052"), metavar="ADDR",
                   help="memsvc host:port (env PAGEDSERVE_MEMSVC; default 127.0.0.1:50052)")
    p.add_argument("--executor", default=_env("EXECUTOR", "127.0.0.1:50053"), metavar="ADDR",
                   help="executor host:port (env PAGEDSERVE_EXECUTOR; default 127.0.0.1:50053)")
    p.add_argument("--max-num-seqs", type=int, default=_env("MAX_NUM_SEQS", 64, int),
                   help="sequences per step (env PAGEDSERVE_MAX_NUM_SEQS; default 64)")
    p.add_argument("--max-num-batched-tokens", type=int,
                   default=_env("MAX_NUM_BATCHED_TOKENS", 2048, int),
                   help="tokens per step (env PAGEDSERVE_MAX_NUM_BATCHED_TOKENS; default 2048)")
    add_replica_args(p)
    add_http_args(p)


def add_replica_args(p: argparse.ArgumentParser) -> None:
    """Several executor replicas behind this gateway (gateway.replica_set) and how to route."""
    p.add_argument("--replica", action="append", default=None, metavar="MEMSVC,EXECUTOR",
                   help="an executor replica: its memsvc and executor host:port; repeat for several "
                        "(env PAGEDSERVE_REPLICAS: space-separated; replaces --memsvc/--executor)")
    p.add_argument("--discover", default=_env("DISCOVER", None), metavar="DNS_NAME",
                   help="find replicas by DNS: every address of DNS_NAME (e.g. a headless Service) "
                        "is a replica, resolved again every 5 s (env PAGEDSERVE_DISCOVER)")
    p.add_argument("--discover-ports", default=_env("DISCOVER_PORTS", "50052,50053"),
                   metavar="MEMSVC_PORT,EXECUTOR_PORT",
                   help="the ports of memsvc and the executor at each discovered address "
                        "(env PAGEDSERVE_DISCOVER_PORTS; default 50052,50053)")
    p.add_argument("--routing", default=_env("ROUTING", "prefix"), choices=["prefix", "round-robin"],
                   help="how requests are spread over replicas: prefix-cache affinity and load, or "
                        "round-robin (env PAGEDSERVE_ROUTING; default prefix)")


def replica_addresses(args) -> list[tuple[str, str]]:
    """The (memsvc, executor) pairs of --replica (or PAGEDSERVE_REPLICAS); [] when none."""
    items = args.replica if args.replica else _env("REPLICAS", "").split()
    pairs = []
    for item in items:
        parts = item.split(",")
        if len(parts) != 2 or not all(parts):
            raise ValueError(f"--replica wants MEMSVC_ADDR,EXECUTOR_ADDR, got {item!r}")
        pairs.append((parts[0], parts[1]))
    return pairs


def replica_set(args, service, tls=None):
    """A ReplicaSet over the replicas of `args`, making step runners with `service`."""
    from gateway.replica_set import ReplicaSet
    from gateway.router import Router

    router = Router(args.routing, block_size=16, max_num_seqs=args.max_num_seqs,
                    registry=service.metrics.registry)
    discover = None
    if args.discover:
        from gateway.discovery import dns_replicas, parse_ports

        memsvc_port, executor_port = parse_ports(args.discover_ports)
        discover = lambda: dns_replicas(args.discover, memsvc_port, executor_port)  # noqa: E731
    replicas = ReplicaSet(replica_addresses(args), lambda m, e: connect_remote(m, e, tls),
                          lambda backend, on_error: service.build_runner(backend, on_error),
                          router, service.telemetry, discover=discover)

    def connect():
        replicas.connect_any()
        router.block_size = replicas.info.kv.block_size
        return replicas
    return connect


def add_http_args(p: argparse.ArgumentParser) -> None:
    """The OpenAI-compatible HTTP API's flags (shared by `pagedserve serve`)."""
    p.add_argument("--http-host", default=_env("HTTP_HOST", "127.0.0.1"),
                   help="address of the OpenAI-compatible HTTP API (env PAGEDSERVE_HTTP_HOST; "
                        "default 127.0.0.1)")
    p.add_argument("--http-port", type=int, default=_env("HTTP_PORT", 8000, int),
                   help="port of the OpenAI-compatible HTTP API, 0 to turn it off "
                        "(env PAGEDSERVE_HTTP_PORT; default 8000)")
    p.add_argument("--api-key", default=_env("API_KEY", None),
                   help="require this key from clients, as 'Authorization: Bearer KEY' "
                        "(env PAGEDSERVE_API_KEY; default: no key)")


def connect_remote(memsvc: str, executor: str, tls=None) -> Backend:
    """Clients of memsvc and the executor, once both answer; raises while either does not."""
    from gateway.remote import RemoteExecutorClient, RemoteMemoryClient, tokenizer_dir_from_info
    from gateway.tokenizer import load_tokenizer

    executor_client = RemoteExecutorClient(executor, tls=tls)
    memory_client = None
    try:
        info = executor_client.model_info()  # UNAVAILABLE until its pool is mapped
        memory_client = RemoteMemoryClient(memsvc, tls=tls)
        memory_client.stats()
        tokenizer = load_tokenizer(tokenizer_dir_from_info(info))
    except BaseException:
        executor_client.close()
        if memory_client is not None:
            memory_client.close()
        raise
    return Backend(memory_client, executor_client, tokenizer,
                   check=lambda: _check_serving({"executor": executor, "memsvc": memsvc}, tls))


def _check_serving(addresses: dict[str, str], tls=None) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    for name, address in addresses.items():
        with open_channel(address, tls) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=2.0).status
        if status != SERVING:
            raise ConnectionError(f"{name} at {address} is not SERVING")


async def serve(args) -> int:
    log = get_logger("gateway")
    from wire.metrics import serve_metrics
    from wire.tracing import setup_tracing, shutdown_tracing

    scheduler = SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                max_num_batched_tokens=args.max_num_batched_tokens)
    tls = tls_from_args(args)
    setup_tracing("gateway")
    gateway = Gateway(lambda: connect_remote(args.memsvc, args.executor, tls), scheduler,
                      host=args.host, port=args.port, max_waiting=args.max_waiting,
                      step_retry_s=args.step_retry_timeout, api_key=getattr(args, "api_key", None) or None,
                      credentials=tls.server_credentials(require_client_cert=False))
    if replica_addresses(args) or args.discover:
        gateway.connect = replica_set(args, gateway.service, tls)
    try:
        port = await gateway.start()
    except RuntimeError as e:
        log.error("cannot listen on %s:%d: %s", args.host, args.port, e)
        return 1
    try:
        serve_metrics(gateway.service.metrics.registry, args.host, args.metrics_port, log)
    except OSError as e:
        log.error("cannot serve metrics on %s:%s: %s", args.host, args.metrics_port, e)
        await gateway.stop(grace=0)
        return 1
    backends = replica_addresses(args) or ([] if args.discover else [(args.memsvc, args.executor)])
    log.info("listening on %s:%d (NOT_SERVING until a replica answers: %s; routing %s)", args.host,
             port, " ".join(f"memsvc {m} + executor {e}" for m, e in backends)
             or f"every address of {args.discover}", args.routing)
    http = None
    if args.http_port:
        from gateway.openai_server import start_openai

        try:
            http = await start_openai(gateway, args.http_host, args.http_port, args.api_key,
                                      grace=args.shutdown_grace)
        except OSError as e:
            log.error("cannot listen on %s:%d (HTTP): %s", args.http_host, args.http_port, e)
            await gateway.stop(grace=0)
            return 1
        log.info("OpenAI-compatible HTTP API on http://%s:%d/v1%s", args.http_host, http.port,
                 " (API key required)" if args.api_key else "")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("stopping")
    await asyncio.gather(gateway.stop(grace=args.shutdown_grace), *([http.stop()] if http else []))
    shutdown_tracing()
    log.info("stopped")
    return 0


def run(args) -> int:
    import uvloop

    try:
        SchedulerConfig(max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens)
        if args.max_waiting < 0:
            raise ValueError(f"--max-waiting must be >= 0, got {args.max_waiting}")
        replica_addresses(args)
        if args.discover:
            from gateway.discovery import parse_ports

            parse_ports(args.discover_ports)
        tls_from_args(args).server_credentials(require_client_cert=False)
    except (ValueError, OSError) as e:
        print(f"pagedserve gateway: {e}", file=sys.stderr)
        return 2
    return uvloop.run(serve(args))


def add_reliability_args(p: argparse.ArgumentParser) -> None:
    """Queue bound, step retries, graceful stop, metrics, TLS and the API key. `--api-key`
    is shared with the HTTP API when that is there: the same key guards both."""
    p.add_argument("--max-waiting", type=int, default=_env("MAX_WAITING", 0, int), metavar="N",
                   help="refuse a request with RESOURCE_EXHAUSTED while N sequences wait for a step "
                        "(env PAGEDSERVE_MAX_WAITING; default 0: no bound)")
    p.add_argument("--step-retry-timeout", type=float, default=_env("STEP_RETRY_TIMEOUT", 60.0, float),
                   metavar="SECONDS", help="keep retrying a step while memsvc or the executor restarts "
                                           "this long before failing its requests "
                                           "(env PAGEDSERVE_STEP_RETRY_TIMEOUT; default 60)")
    p.add_argument("--shutdown-grace", type=float, default=_env("SHUTDOWN_GRACE", 10.0, float),
                   metavar="SECONDS", help="on SIGTERM, let running streams finish this long "
                                           "(env PAGEDSERVE_SHUTDOWN_GRACE; default 10)")
    add_metrics_argument(p)
    add_tls_arguments(p)
    try:
        p.add_argument("--api-key", default=_env("API_KEY", None),
                       help="require metadata 'authorization: Bearer KEY' on the gRPC API "
                            "(env PAGEDSERVE_API_KEY; default: no key)")
    except argparse.ArgumentError:
        pass  # already there (the HTTP API's): one key for both APIs
