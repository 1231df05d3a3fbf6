"""`pagedserve gateway`: the public Generation service in front of a remote memsvc and executor."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from gateway.scheduler import SchedulerConfig
from gateway.server import Backend, Gateway


def _env(name: str, default):
    return os.environ.get(f"PAGEDSERVE_{name}", default)


def add_gateway_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default=_env("GATEWAY_HOST", "127.0.0.1"),
                   help="address to listen on (env PAGEDSERVE_GATEWAY_HOST; default 127.0.0.1)")
    p.add_argument("--port", type=int, default=int(_env("GATEWAY_PORT", 50051)),
                   help="port to listen on (env PAGEDSERVE_GATEWAY_PORT; default 50051)")
    p.add_argument("--memsvc", default=_env("MEMSVC_ADDR", "127.0.0.1:50052"), metavar="ADDR",
                   help="memsvc host:port (env PAGEDSERVE_MEMSVC_ADDR; default 127.0.0.1:50052)")
    p.add_argument("--executor", default=_env("EXECUTOR_ADDR", "127.0.0.1:50053"), metavar="ADDR",
                   help="executor host:port (env PAGEDSERVE_EXECUTOR_ADDR; default 127.0.0.1:50053)")
    p.add_argument("--max-num-seqs", type=int, default=int(_env("MAX_NUM_SEQS", 64)),
                   help="sequences per step (env PAGEDSERVE_MAX_NUM_SEQS; default 64)")
    p.add_argument("--max-num-batched-tokens", type=int,
                   default=int(_env("MAX_NUM_BATCHED_TOKENS", 2048)),
                   help="tokens per step (env PAGEDSERVE_MAX_NUM_BATCHED_TOKENS; default 2048)")


def connect_remote(memsvc: str, executor: str) -> Backend:
    """Clients of memsvc and the executor, once both answer; raises while either does not."""
    from gateway.remote import RemoteExecutorClient, RemoteMemoryClient, tokenizer_dir_from_info
    from gateway.tokenizer import load_tokenizer

    executor_client = RemoteExecutorClient(executor)
    info = executor_client.model_info()
    memory_client = RemoteMemoryClient(memsvc)
    memory_client.stats()
    tokenizer = load_tokenizer(tokenizer_dir_from_info(info))
    return Backend(memory_client, executor_client, tokenizer)


async def serve(args) -> None:
    scheduler = SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                max_num_batched_tokens=args.max_num_batched_tokens)
    gateway = Gateway(lambda: connect_remote(args.memsvc, args.executor), scheduler,
                      host=args.host, port=args.port)
    port = await gateway.start()
    logging.getLogger("pagedserve.gateway").info(
        "listening on %s:%d (NOT_SERVING until memsvc %s and executor %s answer)",
        args.host, port, args.memsvc, args.executor)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await gateway.stop(grace=2.0)


def run(args) -> int:
    import uvloop

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        SchedulerConfig(max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens)
    except ValueError as e:
        print(f"pagedserve gateway: {e}", file=sys.stderr)
        return 2
    uvloop.run(serve(args))
    return 0
