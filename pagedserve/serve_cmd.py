"""`pagedserve serve` (memsvc, executor and gateway as three local processes) and `pagedserve gateway`."""
from __future__ import annotations

import argparse
import socket
import sys

from gateway.main import add_gateway_args, add_http_args
from gateway.main import add_reliability_args


def add_parsers(sub) -> None:
    p = sub.add_parser("serve", help="serve a model: memsvc, executor and gateway on this host",
                       description="Start memsvc, the executor and the gateway as three processes "
                                   "on 127.0.0.1; restart any that crashes; stop all on Ctrl-C.")
    p.add_argument("--model", default=None,
                   help="a Hugging Face model directory or a .gguf file (default: the built-in "
                        "SmolLM2-135M-Instruct)")
    p.add_argument("--port", type=int, default=50051, help="the gateway's port (default: 50051)")
    p.add_argument("--memsvc-port", type=int, default=0, help="memsvc's port (default: a free one)")
    p.add_argument("--executor-port", type=int, default=0,
                   help="the executor's port (default: a free one)")
    kv = p.add_mutually_exclusive_group()
    kv.add_argument("--kv-tokens", type=int, default=None, help="size the KV pool by tokens")
    kv.add_argument("--kv-memory", type=float, default=None, metavar="GiB",
                    help="size the KV pool by memory (default: 2 GiB)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: 16)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="weights and KV dtype (default: float32)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="cap on prompt + output tokens (default: the model's maximum)")
    p.add_argument("--no-prefix-caching", action="store_true", help="turn the prefix cache off")
    p.add_argument("--max-waiting", type=int, default=0, metavar="N",
                   help="the gateway refuses requests (RESOURCE_EXHAUSTED) while N sequences wait "
                        "(default: 0, no bound)")
    p.add_argument("--shutdown-grace", type=float, default=10.0, metavar="SECONDS",
                   help="on Ctrl-C/SIGTERM, running streams get this long to finish (default: 10)")
    p.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="the gateway's Prometheus /metrics port; memsvc and the executor then get "
                        "free ports, logged at start (default: no metrics)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences per step (default: 64)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="tokens per step (default: 2048)")
    p.add_argument("--replicas", type=int, default=1, metavar="R",
                   help="executor replicas (memsvc + executor pairs, each with its own pool) behind "
                        "every gateway (default: 1)")
    p.add_argument("--gateways", type=int, default=1, metavar="G",
                   help="gateways sharing the replicas; gateway i listens on --port + i, and only the "
                        "first serves the HTTP API (default: 1)")
    p.add_argument("--routing", default="prefix", choices=["prefix", "round-robin"],
                   help="how gateways spread requests over replicas (default: prefix)")
    p.add_argument("--session-lease", type=float, default=None, metavar="SECONDS",
                   help="memsvc frees a gateway's sequences after this long without a call "
                        "(default: memsvc's)")
    add_http_args(p)
    p.set_defaults(run=run_serve)

    g = sub.add_parser("gateway", help="the public gRPC API, in front of memsvc and an executor",
                       description="Serve pagedserve.v1.Generation; batch requests onto a remote "
                                   "memsvc and executor.")
    add_gateway_args(g)
    add_reliability_args(g)
    g.set_defaults(run=run_gateway)


def run_gateway(args) -> int:
    from gateway.main import run

    return run(args)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def suffix(i: int) -> str:
    """Names of the i-th replica's or gateway's services: memsvc, memsvc-1, ..."""
    return f"-{i}" if i else ""


def service_specs(args, host: str = "127.0.0.1"):
    """The services of `serve`, in start order: memsvc and executor per replica, then gateways."""
    if getattr(args, "replicas", 1) > 1 or getattr(args, "gateways", 1) > 1:
        return scaled_specs(args, host)
    return single_specs(args, host)


def scaled_specs(args, host: str = "127.0.0.1"):
    """R memsvc+executor pairs (ports chosen free) and G gateways (--port + i), each gateway
    with every replica (--replica MEMSVC,EXECUTOR)."""
    from pagedserve.supervisor import ServiceSpec

    if args.replicas < 1 or args.gateways < 1:
        raise ValueError("--replicas and --gateways must be >= 1")
    specs, pairs = [], []
    for i in range(args.replicas):
        replica_args = argparse.Namespace(**{**vars(args), "memsvc_port": 0, "executor_port": 0,
                                             "replicas": 1, "gateways": 1})
        memsvc, executor, _ = single_specs(replica_args, host)
        memsvc.name, executor.name = f"memsvc{suffix(i)}", f"executor{suffix(i)}"
        memsvc.restart_with = [executor.name]
        specs += [memsvc, executor]
        pairs.append(f"{memsvc.address},{executor.address}")
    cli = [sys.executable, "-m", "pagedserve.cli"]
    for i in range(args.gateways):
        http_port = args.http_port if i == 0 else 0
        specs.append(ServiceSpec(
            f"gateway{suffix(i)}",
            cli + ["gateway", "--host", host, "--port", str(args.port + i),
                   *[a for pair in pairs for a in ("--replica", pair)], "--routing", args.routing,
                   "--max-num-seqs", str(args.max_num_seqs),
                   "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                   "--http-host", args.http_host, "--http-port", str(http_port)],
            f"{host}:{args.port + i}", health_service="pagedserve.v1.Generation",
            env={"PAGEDSERVE_API_KEY": args.api_key} if args.api_key else {}))
    return specs


def single_specs(args, host: str = "127.0.0.1"):
    """The three services of a one-replica, one-gateway `serve`, in start order."""
    from pagedserve.supervisor import ServiceSpec

    memsvc = f"{host}:{args.memsvc_port or free_port(host)}"
    executor = f"{host}:{args.executor_port or free_port(host)}"
    gateway = f"{host}:{args.port}"
    cli = [sys.executable, "-m", "pagedserve.cli"]
    kv = (["--kv-tokens", str(args.kv_tokens)] if args.kv_tokens is not None
          else ["--kv-memory", str(args.kv_memory)] if args.kv_memory is not None else [])
    model = ["--model", args.model] if args.model else []
    model += ["--dtype", args.dtype]
    if args.max_model_len:
        model += ["--max-model-len", str(args.max_model_len)]
    if args.no_prefix_caching:
        kv += ["--no-prefix-caching"]
    return [
        ServiceSpec("memsvc", cli + ["memsvc", "--host", host, "--port", memsvc.split(":")[1], *kv],
                    memsvc, restart_with=["executor"],
                    shm_patterns=["/dev/shm/pagedserve-kv-{pid}-*"]),
        ServiceSpec("executor", cli + ["executor", "--host", host, "--port", executor.split(":")[1],
                                       "--memsvc", memsvc, "--block-size", str(args.block_size), *model],
                    executor),
        ServiceSpec("gateway", cli + ["gateway", "--host", host, "--port", str(args.port),
                                      "--memsvc", memsvc, "--executor", executor,
                                      "--max-num-seqs", str(args.max_num_seqs),
                                      "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                                      "--http-host", args.http_host, "--http-port", str(args.http_port)],
                    gateway, health_service="pagedserve.v1.Generation",
                    env={"PAGEDSERVE_API_KEY": args.api_key} if args.api_key else {}),
    ]


def with_reliability(specs, args):
    """Add the queue bound, shutdown grace and metrics flags of `serve` to its services."""
    port = getattr(args, "metrics_port", None)
    lease = getattr(args, "session_lease", None)
    for spec in specs:
        kind = spec.name.split("-")[0]
        if kind == "gateway":
            spec.argv += ["--max-waiting", str(getattr(args, "max_waiting", 0)),
                          "--shutdown-grace", str(getattr(args, "shutdown_grace", 10.0))]
            if port is not None:  # the first gateway on --metrics-port, the others on free ports
                spec.argv += ["--metrics-port", str(port) if spec.name == "gateway" else "0"]
        elif port is not None:
            spec.argv += ["--metrics-port", "0"]
        if kind == "memsvc" and lease is not None:
            spec.argv += ["--session-lease", str(lease)]
    return specs


def list_models(address: str, api_key: str | None) -> str:
    """The name of the model the gateway serves (with the API key when one is set)."""
    import grpc

    from wire.v1 import generation_pb2, generation_pb2_grpc

    metadata = [("authorization", f"Bearer {api_key}")] if api_key else None
    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        return stub.ListModels(generation_pb2.ListModelsRequest(), timeout=10, metadata=metadata).models[0].name


def run_serve(args) -> int:
    from pagedserve.supervisor import ServiceFailed, Supervisor

    sup = Supervisor(with_reliability(service_specs(args), args), grace=args.shutdown_grace + 5)
    sup.install_signal_handlers()
    try:
        sup.start()
        if not sup.stopping:
            address = sup.by_name["gateway"].spec.address
            name = list_models(address, getattr(args, "api_key", None))
            gateways = [r.spec.address for r in sup.services if r.spec.name.startswith("gateway")]
            replicas = getattr(args, "replicas", 1)
            print(f"pagedserve: serving {name} on {' '.join(gateways)}"
                  + (f" ({replicas} replicas, {args.routing} routing)" if replicas > 1 else ""),
                  flush=True)
            if args.http_port:
                print(f"pagedserve: OpenAI-compatible API on http://{args.http_host}:{args.http_port}/v1",
                      flush=True)
            sup.run()
    except ServiceFailed as e:
        sup.log(str(e))
        return 1
    finally:
        sup.stop()
    return 0
