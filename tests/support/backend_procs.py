"""Start memsvc and executor as `python -m <module>` processes on 127.0.0.1 for tests, given the
internal token tests.support.serve_procs.TOKEN; always stop them."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

from pagedserve.rpc.ports import free_port
from tests.support import ROOT
from tests.support.health import wait_for_health
from tests.support.serve_procs import TOKEN, TOKEN_ENV


class ServiceProcess:
    """One service started with `python -m <module> <args>`; its output goes to a log file."""

    def __init__(self, name: str, module: str, args: list[str], log_dir: str):
        self.name = name
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self.log = open(self.log_path, "wb")
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   **{TOKEN_ENV: TOKEN})
        self.proc = subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT, env=env,
                                     stdout=self.log, stderr=subprocess.STDOUT)
        self.seen: list[int | None] = []

    def output(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def wait_serving(self, address: str, timeout: float = 300.0) -> None:
        wait_for_health(address, proc=self.proc, timeout=timeout, name=self.name, log=self.output,
                        seen=self.seen)

    def terminate(self, timeout: float = 15.0) -> int:
        """SIGTERM, then SIGKILL after `timeout`; return the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode
