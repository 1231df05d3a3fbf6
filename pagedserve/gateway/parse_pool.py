"""A few threads that read requests (JSON, checks, chat templates, tokenizing, grammars) off
the asyncio loop that serves every client of the gateway, gRPC and HTTP alike.

Contract: `await pool.run(fn, *args)` runs `fn(*args)` on one of `workers` threads and
returns its result (or raises its exception); meanwhile the loop goes on answering other
clients, health checks included. At most `workers` requests are read at once, the others
wait their turn in order. A caller that is cancelled stops waiting; its `fn` still runs to
its end (each is bounded by the request's size limits). `close()` refuses new work and
drops what has not started.
"""
from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor

DEFAULT_WORKERS = max(2, min(4, os.cpu_count() or 1))


class ParsePool:
    def __init__(self, workers: int = DEFAULT_WORKERS):
        self.workers = workers
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pagedserve-parse")

    async def run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
