"""`pagedserve memsvc`, `pagedserve executor`, `pagedserve gateway`: one service per process.

Each command's flags come from its service's config dataclass (pagedserve.wire.settings): every flag
falls back to a PAGEDSERVE_* environment variable named in its help, so a deployment can
configure a service without a command line. The service module is imported when the
command runs, so building the parser stays light.
"""
from __future__ import annotations

import sys

from pagedserve.executor.config import ExecutorConfig
from pagedserve.gateway.config import GatewayConfig
from pagedserve.memsvc.config import MemsvcConfig
from pagedserve.wire.settings import add_flags, from_args

SERVICES = {
    "memsvc": (MemsvcConfig, "run the KV memory service (owns the pool, grants slots)",
               "Run memsvc: it allocates the KV pool when an executor registers (POSIX shared "
               "memory on the CPU, CUDA IPC on a GPU), answers Reserve/Free/Fork/Stats, and frees "
               "the sequences of gateways that go silent. SIGTERM or Ctrl-C stops it and removes "
               "the shared-memory segment."),
    "executor": (ExecutorConfig, "run the model executor (loads the model, maps memsvc's pool)",
                 "Run an executor: it loads the model, registers with memsvc, maps the KV pool "
                 "memsvc shares with it, and answers ModelInfo (with the tokenizer files) and "
                 "Execute. Health says SERVING once the pool is mapped."),
    "gateway": (GatewayConfig, "the public gRPC and HTTP APIs, in front of memsvc and an executor",
                "Serve pagedserve.v1.Generation and the OpenAI-compatible HTTP API; batch "
                "requests onto remote memsvc and executor replicas."),
}


def config_from(name: str, args):
    """The service's config from parsed flags; ValueError names the flag that is wrong."""
    return from_args(SERVICES[name][0], args)


def _run(name: str, args) -> int:
    try:
        config = config_from(name, args)
    except ValueError as e:
        print(f"pagedserve {name}: {e}", file=sys.stderr)
        return 2
    if name == "memsvc":
        from pagedserve.memsvc.server import serve
    elif name == "executor":
        from pagedserve.executor.server import serve
    else:
        from pagedserve.gateway.main import run as serve
    return serve(config)


def add_parsers(sub) -> None:
    """Register `memsvc`, `executor` and `gateway` on the `pagedserve` subcommand parser."""
    for name, (cls, help_text, description) in SERVICES.items():
        p = sub.add_parser(name, help=help_text, description=description)
        add_flags(p, cls)
        p.set_defaults(run=lambda args, name=name: _run(name, args))
