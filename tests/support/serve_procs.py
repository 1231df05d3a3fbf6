"""Start `pagedserve` commands as real processes on loopback for the serve tests; always stop them.
`serving_http` is the HTTP system tests' module fixture: `pagedserve serve` with its HTTP API,
once /health says 200."""
from __future__ import annotations

import contextlib
import glob
import os
import signal
import subprocess
import sys
import time

from types import SimpleNamespace

from pagedserve.serve_cmd import free_port
from tests.support import ROOT

CLI = [sys.executable, "-m", "pagedserve.cli"]


def start(*args: str, stdout=None) -> subprocess.Popen:
    """`python -m pagedserve.cli ARGS` in its own process group."""
    return subprocess.Popen([*CLI, *args], cwd=ROOT, stdout=stdout, text=True, process_group=0)


def children(pid: int) -> list[int]:
    """Direct children of `pid` (Linux /proc)."""
    out = []
    for path in glob.glob(f"/proc/{pid}/task/*/children"):
        with open(path) as f:
            out += [int(p) for p in f.read().split()]
    return sorted(out)


def cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read().split("\0")
    except FileNotFoundError:
        return []


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def segments(pids: list[int]) -> list[str]:
    return [p for pid in pids for p in glob.glob(f"/dev/shm/pagedserve-kv-{pid}-*")]


def stop(procs: list[subprocess.Popen], grace: float = 20.0) -> None:
    """SIGTERM each process group, then SIGKILL what is left after `grace` seconds."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    """Until `url`/health answers 200; RuntimeError if `proc` exits first."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url}/health was not 200 after {timeout:.0f}s")


@contextlib.contextmanager
def serving_http(*args: str):
    """`pagedserve serve ARGS` with the HTTP API on a free port, once healthy: `url`, `port`
    (gRPC), `memsvc_port`, `proc`. Always stopped."""
    ports = SimpleNamespace(port=free_port(), memsvc_port=free_port(), http_port=free_port())
    proc = start("serve", "--port", str(ports.port), "--memsvc-port", str(ports.memsvc_port),
                 "--http-port", str(ports.http_port), *args)
    try:
        url = f"http://127.0.0.1:{ports.http_port}"
        wait_healthy(url, proc)
        yield SimpleNamespace(url=url, proc=proc, **vars(ports))
    finally:
        stop([proc])
