"""memsvc, an executor (the real model or tests.support.fake_executor_server) and a gateway as real
processes on loopback, for the reliability tests; each logs to a file; always stopped.
`serving_stack` is the system tests' module fixture: a Stack once its gateway serves."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request

import grpc

from pagedserve.rpc.ports import free_port
from pagedserve.rpc.grpc_service import open_channel
from pagedserve.wire.v1 import generation_pb2_grpc, memory_pb2, memory_pb2_grpc
from tests.support import ROOT
from tests.support.health import SERVING, wait_for_health
from tests.support.serve_procs import TOKEN, TOKEN_ENV

# The OpenAI HTTP listener (when this gateway has one) stays off in these tests.
BASE_ENV = {"PAGEDSERVE_HTTP_PORT": "0"}


class Proc:
    """`python -m MODULE ARGS` with extra environment; output to `<log_dir>/<name>.log`."""

    def __init__(self, name: str, module: str, args: list[str], log_dir: str, env: dict | None = None):
        self.name, self.module, self.args = name, module, list(args)
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self.env = dict(os.environ, PYTHONPATH=ROOT, **BASE_ENV, **(env or {}))
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", self.module, *self.args], cwd=ROOT,
                                     env=self.env, stdout=log, stderr=subprocess.STDOUT)
        log.close()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def wait_health(self, address: str, want: int = SERVING, service: str = "", timeout: float = 120.0,
                    credentials=None) -> None:
        wait_for_health(address, want, service, self.proc, timeout, tls=credentials, name=self.name,
                        log=self.output)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def scrape(port: int) -> dict[str, float]:
    """A /metrics page as {'name{labels}': value} (comments dropped)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


class Stack:
    """memsvc + executor + gateway. `fake` picks tests.support.fake_executor_server (fast, exact
    outputs) over the real default model. Addresses, ports and gRPC stubs as attributes. They
    call each other with the internal token TOKEN (`token`: None for a stack closed by mutual
    TLS alone, whose `memsvc_args` and `executor_args` say so)."""

    def __init__(self, log_dir: str, *, fake: bool = True, kv_tokens: int = 4096, lease: float = 10.0,
                 memsvc_args=(), executor_args=(), gateway_args=(), env: dict | None = None,
                 token: str | None = TOKEN):
        self.log_dir = log_dir
        self.ports = {n: free_port() for n in ("memsvc", "executor", "gateway",
                                               "memsvc_metrics", "executor_metrics", "gateway_metrics")}
        self.memsvc = f"127.0.0.1:{self.ports['memsvc']}"
        self.executor = f"127.0.0.1:{self.ports['executor']}"
        self.gateway = f"127.0.0.1:{self.ports['gateway']}"
        self.procs: dict[str, Proc] = {}
        self.token = token
        env = {**({TOKEN_ENV: token} if token else {}), **(env or {})}
        try:
            self.procs["memsvc"] = Proc("memsvc", "pagedserve.cli", [
                "memsvc", "--port", str(self.ports["memsvc"]), "--kv-tokens", str(kv_tokens),
                "--session-lease", str(lease), "--metrics-port", str(self.ports["memsvc_metrics"]),
                *memsvc_args], log_dir, env)
            ex_common = ["--port", str(self.ports["executor"]), "--memsvc", self.memsvc,
                         "--metrics-port", str(self.ports["executor_metrics"]), *executor_args]
            self.procs["executor"] = (Proc("executor", "tests.support.fake_executor_server", ex_common, log_dir, env)
                                      if fake else Proc("executor", "pagedserve.cli", ["executor", *ex_common],
                                                        log_dir, env))
            self.procs["gateway"] = Proc("gateway", "pagedserve.cli", [
                "gateway", "--port", str(self.ports["gateway"]), "--memsvc", self.memsvc,
                "--executor", self.executor, "--metrics-port", str(self.ports["gateway_metrics"]),
                *gateway_args], log_dir, env)
        except BaseException:
            self.stop()
            raise

    def wait_serving(self, timeout: float = 180.0, credentials=None) -> None:
        self.procs["gateway"].wait_health(self.gateway, service="pagedserve.v1.Generation",
                                          timeout=timeout, credentials=credentials)

    def stubs(self):
        """(Generation stub, MemoryManager stub) over plaintext channels (memsvc's with the token)."""
        self._channels = [grpc.insecure_channel(self.gateway), open_channel(self.memsvc, token=self.token)]
        return (generation_pb2_grpc.GenerationStub(self._channels[0]),
                memory_pb2_grpc.MemoryManagerStub(self._channels[1]))

    def memsvc_stats(self) -> memory_pb2.StatsResponse:
        with open_channel(self.memsvc, token=self.token) as ch:
            return memory_pb2_grpc.MemoryManagerStub(ch).Stats(memory_pb2.StatsRequest(), timeout=5)

    def wait_unreferenced(self, timeout: float = 15.0) -> memory_pb2.StatsResponse:
        deadline = time.monotonic() + timeout
        while True:
            stats = self.memsvc_stats()
            if (stats.blocks_referenced == 0 and stats.num_sequences == 0) or time.monotonic() > deadline:
                return stats
            time.sleep(0.1)

    def stop(self) -> None:
        for ch in getattr(self, "_channels", []):
            ch.close()
        for name in ("gateway", "executor", "memsvc"):
            if name in self.procs:
                self.procs[name].stop()


@contextlib.contextmanager
def serving_stack(log_dir: str, *, credentials=None, **options):
    """A Stack (`options` as Stack's) whose gateway says SERVING; with plaintext (no
    `credentials`), `gen` and `mem` are its Generation and MemoryManager stubs. Always stopped."""
    stack = Stack(log_dir, **options)
    try:
        stack.wait_serving(credentials=credentials)
        if credentials is None:
            stack.gen, stack.mem = stack.stubs()
        yield stack
    finally:
        stack.stop()
