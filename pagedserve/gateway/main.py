"""`pagedserve gateway`: the public Generation service in front of a remote memsvc and executor."""
from __future__ import annotations

import asyncio
import signal
import sys

from pagedserve.gateway import chat_template, grammar_budget
from pagedserve.gateway.config import GatewayConfig
from pagedserve.gateway.generation_service import Backend
from pagedserve.gateway.server import SERVING, Gateway
from pagedserve.rpc.grpc_service import get_logger, open_channel
from pagedserve.rpc.heap import freeze_heap


def replica_set(config: GatewayConfig, service, tls=None, token: str | None = None,
                template: str | None = None):
    """A ReplicaSet over the replicas of `config`, making step runners with `service`
    (`template`: --chat-template's text)."""
    from pagedserve.gateway.replica_set import ReplicaSet
    from pagedserve.gateway.router import Router

    from pagedserve.gateway.scheduler_config import CPU_MAX_NUM_SEQS

    # (the replicas' executors may differ: the queue's scale is the flag or the CPU's default)
    router = Router(config.routing, block_size=16, max_num_seqs=config.scheduler.max_num_seqs or CPU_MAX_NUM_SEQS,
                    registry=service.metrics.registry)
    discover = None
    if config.discover:
        from pagedserve.gateway.discovery import dns_replicas, parse_ports

        memsvc_port, executor_port = parse_ports(config.discover_ports)
        discover = lambda: dns_replicas(config.discover, memsvc_port, executor_port)  # noqa: E731
    replicas = ReplicaSet(config.replica_addresses(),
                          lambda m, e: connect_remote(m, e, tls, token, template),
                          lambda backend, on_error: service.build_runner(backend, on_error),
                          router, service.telemetry, discover=discover)

    def connect():
        replicas.connect_any()
        router.block_size = replicas.info.kv.block_size
        return replicas
    return connect


def connect_remote(memsvc: str, executor: str, tls=None, token: str | None = None,
                   chat_template: str | None = None) -> Backend:
    """Clients of memsvc and the executor (calling with the internal `token`), once both
    answer; raises while either does not. `chat_template` (--chat-template's text) replaces
    the model's."""
    from pagedserve.gateway import grammar_compile
    from pagedserve.gateway.byte_tables import byte_table
    from pagedserve.gateway.remote import RemoteExecutorClient, RemoteMemoryClient, tokenizer_dir_from_info
    from pagedserve.gateway.tokenizer import load_tokenizer

    executor_client = RemoteExecutorClient(executor, tls=tls, token=token)
    memory_client = None
    try:
        info = executor_client.model_info()  # UNAVAILABLE until its pool is mapped
        memory_client = RemoteMemoryClient(memsvc, tls=tls, token=token)
        memory_client.stats()
        executor_client.tables = memory_client.tables  # to resend an executor its state
        tokenizer = load_tokenizer(tokenizer_dir_from_info(info))
    except BaseException:
        executor_client.close()
        if memory_client is not None:
            memory_client.close()
        raise
    if chat_template:
        tokenizer.chat_template = chat_template
    byte_table(tokenizer)  # built now rather than for the first request (pagedserve.gateway.byte_detokenizer)
    grammar_compile.bind(tokenizer, info.vocab_size, info.eos_token_ids)  # grammars compile at admission
    freeze_heap()  # start-up is done: imports, tokenizer
    return Backend(memory_client, executor_client, tokenizer,
                   check=lambda: _check_serving({"executor": executor, "memsvc": memsvc}, tls))


def _check_serving(addresses: dict[str, str], tls=None) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    for name, address in addresses.items():
        with open_channel(address, tls) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=2.0).status
        if status != SERVING:  # it answers: starting or draining (route nothing new there)
            from pagedserve.gateway.replica_set import Draining

            raise Draining(f"{name} at {address} is not SERVING")


async def serve(config: GatewayConfig) -> int:
    log = get_logger("gateway")
    from pagedserve.rpc.metrics import serve_metrics
    from pagedserve.rpc.tracing import setup_tracing, shutdown_tracing

    tls, token = config.tls, config.internal_token
    if not token and not (tls.cert and tls.ca):
        log.warning("no --internal-token and no mutual TLS: memsvc and the executors must run "
                    "with --insecure-internal to take this gateway's calls")
    try:
        template = chat_template.load(config.chat_template)
    except ValueError as e:
        log.error("%s", e)
        return 1
    setup_tracing("gateway", config.tracing)
    grammar_budget.configure(config.grammar)
    gateway = Gateway(lambda: connect_remote(config.memsvc, config.executor, tls, token, template),
                      config.scheduler,
                      host=config.host, port=config.port, max_waiting=config.max_waiting,
                      step_retry_s=config.step_retry_timeout, api_key=config.api_key or None,
                      credentials=tls.server_credentials(require_client_cert=False),
                      max_message_bytes=config.max_request_bytes,
                      reasoning_parser=config.reasoning_parser,
                      served_model_name=config.served_model_name)
    if config.replica or config.discover:
        gateway.connect = replica_set(config, gateway.service, tls, token, template)
    try:
        port = await gateway.start()
    except RuntimeError as e:
        log.error("cannot listen on %s:%d: %s", config.host, config.port, e)
        return 1
    try:
        serve_metrics(gateway.service.metrics.registry, config.host, config.metrics_port, log)
    except OSError as e:
        log.error("cannot serve metrics on %s:%s: %s", config.host, config.metrics_port, e)
        await gateway.stop(grace=0)
        return 1
    backends = config.replica_addresses() or ([] if config.discover else [(config.memsvc, config.executor)])
    log.info("listening on %s:%d (NOT_SERVING until a replica answers: %s; routing %s)", config.host,
             port, " ".join(f"memsvc {m} + executor {e}" for m, e in backends)
             or f"every address of {config.discover}", config.routing)
    http = None
    if config.http_port:
        from pagedserve.gateway.openai.server import start_openai

        try:
            http = await start_openai(gateway, config.http_host, config.http_port, config.api_key, tls=tls,
                                      write_timeout=config.http_write_timeout,
                                      max_body_bytes=config.max_request_bytes,
                                      metrics_upstreams=config.upstreams())
        except OSError as e:
            log.error("cannot listen on %s:%d (HTTP): %s", config.http_host, config.http_port, e)
            await gateway.stop(grace=0)
            return 1
        scheme = "https" if tls.cert else "http"
        log.info("OpenAI-compatible HTTP API on %s://%s:%d/v1%s, metrics on %s://%s:%d/metrics",
                 scheme, config.http_host, http.port, " (API key required)" if config.api_key else "",
                 scheme, config.http_host, http.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("draining: NOT_SERVING; running requests go on for up to %gs (--drain-timeout)",
             config.drain_timeout)
    await gateway.drain(config.drain_timeout)
    if http is not None:
        await http.stop()
    await gateway.stop(grace=0)
    shutdown_tracing()
    log.info("stopped")
    return 0


def run(config: GatewayConfig) -> int:
    """Serve until SIGTERM/SIGINT, then drain (Gateway.drain, --drain-timeout) and stop; 2 for
    settings that cannot work (told on stderr)."""
    import uvloop

    try:
        if config.discover:
            from pagedserve.gateway.discovery import parse_ports

            parse_ports(config.discover_ports)
        config.tls.server_credentials(require_client_cert=False)
    except (ValueError, OSError) as e:
        print(f"pagedserve gateway: {e}", file=sys.stderr)
        return 2
    return uvloop.run(serve(config))
