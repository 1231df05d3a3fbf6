"""The budget of a guided request's grammar at admission: how large its spec may be, how long
checking and compiling it may take, and the few threads that do that work, off the event
loop that serves every client and off the step.

Contract:
- `GrammarBudget`: the settings (--grammar-max-bytes, --grammar-compile-timeout,
  --grammar-workers), nested in pagedserve.gateway.config.GatewayConfig.
- `GrammarChecks(budget).run(kind, spec, work)` returns `work(kind, spec)`, computed on one
  of `grammar_workers` threads; a ValueError it raises is raised again with its message. It
  blocks the calling thread (any thread) at most `grammar_compile_timeout` seconds, the
  wait for a free worker included. Past that it raises GrammarBudgetExceeded (a ValueError
  naming the budget and its flag): a work that had not started is dropped; one that had
  keeps its thread until it ends (a thread cannot be stopped), so at most `grammar_workers`
  run at once however many requests wait; the process does not wait for it to exit. A spec over `grammar_max_bytes` raises at once.
- Verdicts are kept by (kind, spec digest), least recently used out past MAX_VERDICTS or
  VERDICT_BYTES: a spec checked before costs nothing, and one that ran past the budget is
  refused at once when it comes again. A work that waited for a worker but did not start in
  time leaves no verdict (GrammarBusy says so).
- `configure(budget)` sets the process's checks (pagedserve.gateway.main, from the flags); `checks()`
  returns them (the defaults until configured).
"""
from __future__ import annotations

import collections
import hashlib
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Callable

from pagedserve.rpc.daemon_pool import DaemonPool
from pagedserve.wire.settings import setting

OVERRUN = "checking and compiling the grammar took over"
MAX_VERDICTS = 4096
VERDICT_BYTES = 32 << 20


@dataclass
class GrammarBudget:
    grammar_max_bytes: int = setting(128 << 10, "largest guided spec (JSON schema, regex, grammar, "
                                     "choices, tool schemas) a request may send; larger: 400",
                                     metavar="BYTES")
    grammar_compile_timeout: float = setting(10.0, "how long checking and compiling one request's "
                                             "grammar may take at admission, the wait for a free "
                                             "grammar worker included; longer: 400",
                                             metavar="SECONDS")
    grammar_workers: int = setting(2, "threads that check and compile grammars at admission: at "
                                   "most this many run at once, one that overruns included",
                                   metavar="N")

    def __post_init__(self) -> None:
        if self.grammar_max_bytes < 1:
            raise ValueError(f"--grammar-max-bytes must be positive, got {self.grammar_max_bytes}")
        if not self.grammar_compile_timeout > 0:
            raise ValueError(f"--grammar-compile-timeout must be positive, got {self.grammar_compile_timeout}")
        if self.grammar_workers < 1:
            raise ValueError(f"--grammar-workers must be at least 1, got {self.grammar_workers}")


class GrammarBudgetExceeded(ValueError):
    """The spec is over a budget; the message names it and the flag that sets it."""


class GrammarBusy(GrammarBudgetExceeded):
    """No grammar worker was free in time: other requests' grammars hold every one."""


class GrammarChecks:
    def __init__(self, budget: GrammarBudget | None = None):
        self.budget = budget or GrammarBudget()
        self._pool = DaemonPool(self.budget.grammar_workers, "pagedserve-grammar-check")
        self._verdicts: collections.OrderedDict[tuple, tuple[bool, str]] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def run(self, kind: str, spec: str, work: Callable[[str, str], str]) -> str:
        data = spec.encode("utf-8", "surrogatepass")
        if len(data) > self.budget.grammar_max_bytes:
            raise GrammarBudgetExceeded(
                f"the guided spec is {len(data)} bytes, over the budget of {self.budget.grammar_max_bytes} "
                "bytes (--grammar-max-bytes): send a smaller schema or grammar, or raise --grammar-max-bytes")
        key = (kind, hashlib.blake2b(data, digest_size=16).digest())
        verdict = self._verdict(key)
        if verdict is None:
            submitted, started = time.monotonic(), []
            future = self._pool.submit(self._work, key, kind, spec, work, started)
            try:
                verdict = future.result(self.budget.grammar_compile_timeout)
            except FutureTimeout:
                verdict = self._overran(key, future, submitted, started)
        ok, value = verdict
        if not ok:
            raise (GrammarBudgetExceeded if value.startswith(OVERRUN) else ValueError)(value)
        return value

    def shutdown(self) -> None:
        self._pool.shutdown()

    def _work(self, key, kind: str, spec: str, work, started: list[float]) -> tuple[bool, str]:
        known = self._verdict(key)  # settled by another request while this one queued
        if known is not None:
            return known
        started.append(time.monotonic())
        try:
            verdict = (True, work(kind, spec))
        except ValueError as e:
            verdict = (False, str(e))
        if time.monotonic() - started[0] > self.budget.grammar_compile_timeout:
            verdict = (False, self._too_slow())
        self._remember(key, verdict)
        return verdict

    def _overran(self, key, future, submitted: float, started: list[float]) -> tuple[bool, str]:
        timeout = self.budget.grammar_compile_timeout
        if future.done() and not future.cancelled():  # it ended just now
            return future.result()
        if future.cancel() or not started:  # it never started: every worker was busy
            known = self._verdict(key)
            if known is not None:
                return known
            raise GrammarBusy(
                f"no grammar worker was free within {timeout:g} s (--grammar-compile-timeout): all "
                f"{self.budget.grammar_workers} (--grammar-workers) are checking other requests' "
                "grammars; retry later")
        verdict = (False, self._too_slow())
        if started[0] - submitted < 0.1 * timeout:  # it had (nearly) the whole budget: remember;
            self._remember(key, verdict)  # else it goes on and remembers what it finds
        return verdict

    def _too_slow(self) -> str:
        return (f"{OVERRUN} {self.budget.grammar_compile_timeout:g} s, "
                "the budget per request (--grammar-compile-timeout): simplify it (large repetition "
                "counts such as {1,16000} are costly) or raise --grammar-compile-timeout")

    def _verdict(self, key) -> tuple[bool, str] | None:
        with self._lock:
            verdict = self._verdicts.get(key)
            if verdict is not None:
                self._verdicts.move_to_end(key)
            return verdict

    def _remember(self, key, verdict: tuple[bool, str]) -> None:
        with self._lock:
            old = self._verdicts.pop(key, None)
            if old is not None:
                self._bytes -= len(old[1])
            self._verdicts[key] = verdict
            self._bytes += len(verdict[1])
            while self._verdicts and (len(self._verdicts) > MAX_VERDICTS or self._bytes > VERDICT_BYTES):
                _, dropped = self._verdicts.popitem(last=False)
                self._bytes -= len(dropped[1])


_checks: GrammarChecks | None = None
_checks_lock = threading.Lock()


def configure(budget: GrammarBudget) -> GrammarChecks:
    """Check every later request's grammar within `budget` (replaces the checks in use)."""
    global _checks
    with _checks_lock:
        old, _checks = _checks, GrammarChecks(budget)
    if old is not None:
        old.shutdown()
    return _checks


def checks() -> GrammarChecks:
    global _checks
    with _checks_lock:
        if _checks is None:
            _checks = GrammarChecks()
        return _checks
