"""A fixed pool of daemon worker threads: `submit(fn, *args)` returns a Future, as
concurrent.futures.ThreadPoolExecutor does, but a process that exits does not wait for the
work in progress (ThreadPoolExecutor joins its threads at exit). For work that may run long
and whose result nobody needs once the process stops: grammar compiles
(pagedserve.gateway.grammar_budget, pagedserve.executor.grammar_cache).

A Future cancelled before a worker takes it is skipped; `shutdown(wait)` lets the workers
end once the queue is empty, dropping nothing that was queued (`wait`: until they have).
"""
from __future__ import annotations

import queue
import threading
from concurrent.futures import Future


class DaemonPool:
    def __init__(self, workers: int, name: str):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
                         for i in range(workers)]
        for t in self._threads:
            t.start()

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        self._queue.put((future, fn, args))
        return future

    def shutdown(self, wait: bool = False) -> None:
        for _ in self._threads:
            self._queue.put(None)
        if wait:
            for t in self._threads:
                t.join()

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args)
            except BaseException as e:
                future.set_exception(e)
            else:
                future.set_result(result)
