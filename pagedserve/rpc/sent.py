"""A call already sent, whose answer is read on the thread that asks for it (`Sent`), and a
call made now as such a Future (`call_now`): the Futures the step clients answer with
(pagedserve.wire.clients). docs/ARCHITECTURE.md, "The step path".
"""
from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future


class Sent(Future):
    """A call already sent, whose answer `read()` gives on the thread that first asks for it
    (`result`, `exception`; done callbacks run then): not done before it is asked. Lighter
    than a Future another thread completes (no condition variable), so one thread, the
    caller's, reads it."""

    def __init__(self, read: Callable[[], object]):  # no Future.__init__: its lock is not needed
        self._read: Callable[[], object] | None = read
        self._done = False
        self._value = self._error = None
        self._callbacks: list = []

    def _settle(self) -> None:
        read, self._read = self._read, None
        if read is None:
            return
        try:
            self._value = read()
        except BaseException as e:  # noqa: BLE001 - kept for whoever asks, as a Future keeps it
            self._error = e
        self._done = True
        for fn in self._callbacks:
            fn(self)

    def result(self, timeout: float | None = None):
        self._settle()
        if self._error is not None:
            raise self._error
        return self._value

    def exception(self, timeout: float | None = None):
        self._settle()
        return self._error

    def done(self) -> bool:
        return self._done

    def add_done_callback(self, fn) -> None:
        if self._done:
            fn(self)
        else:
            self._callbacks.append(fn)

    def running(self) -> bool:
        return False

    def cancel(self) -> bool:
        return False

    def cancelled(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"<Sent {'done' if self._done else 'not read yet'}>"


def call_now(fn: Callable, *args) -> Future:
    """`fn(*args)` made now, on this thread: a Future done with its answer or its error."""
    future = Sent(lambda: fn(*args))
    future.exception()
    return future
