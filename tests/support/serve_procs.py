"""Start `pagedserve` commands as real processes on loopback for the serve tests; always stop them.
`serving_http` is the HTTP system tests' module fixture: `pagedserve serve` with its HTTP API,
once /health says 200; `serving_grpc` the fault tests': `pagedserve serve` once it says it
serves, with its Generation and MemoryManager stubs. Both hand serve the internal token
(`TOKEN`, by environment, as a deployment would) so that a test can call memsvc itself."""
from __future__ import annotations

import contextlib
import glob
import os
import signal
import subprocess
import sys
import tempfile
import time

from types import SimpleNamespace

from pagedserve.rpc.ports import free_port
from tests.support import ROOT
from pagedserve.rpc.internal_auth import ENV as TOKEN_ENV
from pagedserve.rpc.internal_auth import new_token

CLI = [sys.executable, "-m", "pagedserve.cli"]
TOKEN = new_token()  # the internal token of the services these tests start


def start(*args: str, stdout=None, stderr=None) -> subprocess.Popen:
    """`python -m pagedserve.cli ARGS` in its own process group, given the internal TOKEN."""
    return subprocess.Popen([*CLI, *args], cwd=ROOT, stdout=stdout, stderr=stderr, text=True,
                            process_group=0, env=dict(os.environ, **{TOKEN_ENV: TOKEN}))


def children(pid: int) -> list[int]:
    """Direct children of `pid` (Linux /proc); a thread that ends while they are read is skipped."""
    out = []
    for path in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            with open(path) as f:
                out += [int(p) for p in f.read().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
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


def tail(path: str | None, lines: int = 40) -> str:
    """The last `lines` lines of the file at `path`, to put in an error ("" without one)."""
    if path is None:
        return ""
    with open(path, errors="replace") as f:
        return "\n--- its output, last lines ---\n" + "".join(f.readlines()[-lines:])


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300.0, log: str | None = None) -> None:
    """Until `url`/health answers 200; RuntimeError if `proc` exits first. The error ends with
    the tail of `log`, the file proc writes its output to, if given."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited with {proc.returncode}{tail(log)}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url}/health was not 200 after {timeout:.0f}s{tail(log)}")


@contextlib.contextmanager
def serving_http(*args: str):
    """`pagedserve serve ARGS` with the HTTP API on a free port, once healthy: `url`, `port`
    (gRPC), `memsvc_port`, `proc`; its services take TOKEN. Always stopped. Its output goes to
    a file, printed when it stops (pytest shows it beside a failure) and ending the error if
    it never becomes healthy."""
    ports = SimpleNamespace(port=free_port(), memsvc_port=free_port(), http_port=free_port())
    with tempfile.NamedTemporaryFile("w+", prefix="pagedserve-serve-", suffix=".log") as log:
        proc = start("serve", "--port", str(ports.port), "--memsvc-port", str(ports.memsvc_port),
                     "--http-port", str(ports.http_port), *args, stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{ports.http_port}"
            wait_healthy(url, proc, log=log.name)
            yield SimpleNamespace(url=url, proc=proc, **vars(ports))
        finally:
            stop([proc])
            log.seek(0)
            sys.stdout.write(log.read())


@contextlib.contextmanager
def serving_grpc(*args: str):
    """`pagedserve serve ARGS` (HTTP off) once it prints that it serves: a dict of `proc`,
    `stub` (Generation), `memory` (MemoryManager, calling with TOKEN) and `pids`, a set the
    test adds the processes it kills to. Stopped with SIGTERM (SIGKILL after 60 s); then every
    process in `pids` or ever a child of serve that is still alive is killed."""
    import grpc

    from pagedserve.rpc.grpc_service import open_channel
    from pagedserve.wire.v1 import generation_pb2_grpc, memory_pb2_grpc

    port, mem_port, ex_port = free_port(), free_port(), free_port()
    env = dict(os.environ, PAGEDSERVE_HTTP_PORT="0", PYTHONPATH=ROOT, **{TOKEN_ENV: TOKEN})
    proc = subprocess.Popen([*CLI, "serve", "--port", str(port), "--memsvc-port", str(mem_port),
                             "--executor-port", str(ex_port), *args],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True, process_group=0)
    pids: set[int] = set()
    try:
        assert proc.stdout.readline().startswith("pagedserve: serving"), "serve did not start"
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        mem_channel = open_channel(f"127.0.0.1:{mem_port}", token=TOKEN)
        yield dict(proc=proc, stub=generation_pb2_grpc.GenerationStub(channel), pids=pids,
                   memory=memory_pb2_grpc.MemoryManagerStub(mem_channel))
        channel.close()
        mem_channel.close()
    finally:
        stop_serve(proc, pids)


def stop_serve(proc: subprocess.Popen, pids: set[int] = frozenset()) -> None:
    """SIGTERM to `serve` (SIGKILL to its group after 60 s); then every process in `pids` or a
    child of serve that is still alive is killed."""
    pids = set(pids) | set(children(proc.pid))
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    for p in pids:
        if alive(p):
            os.kill(p, signal.SIGKILL)
