"""A local process supervisor: start services in order, restart crashes, stop them all cleanly.

Contract:
- `start()` launches each service in list order and waits until its grpc health says
  SERVING before launching the next; a service that exits while starting fails `start`.
- `run()` watches the processes until `request_stop()` (SIGINT/SIGTERM when installed):
  a service that exits is restarted after a backoff (doubling, reset once it has run a
  while), and so are the services listed in its `restart_with` (e.g. the executor when
  memsvc, which owns the pool, restarts). Every restart is logged.
- `stop()` stops the services wave by wave, `stop_wave` 0 first (`serve`: the gateways,
  which drain, then the executors, then memsvc): SIGTERM to every service of the wave (in
  reverse start order), then wait for each up to its `stop_grace` (default: `grace`) and
  SIGKILL it after that; only then the next wave. Finally it removes the shared-memory
  segments that processes it started may have left (names from `shm_patterns`, with {pid}
  replaced by each pid it started).
Children run in their own process group (a terminal's Ctrl-C reaches only the supervisor,
which stops them in order) and get SIGTERM if the supervisor dies (Linux PR_SET_PDEATHSIG,
set by the child itself at start, `die_with_supervisor`: no Python runs between fork and
exec, where a parent's gRPC threads and fork handlers have crashed children).
"""
from __future__ import annotations

import ctypes
import glob
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.rpc.grpc_service import open_channel
from pagedserve.rpc.tls import TlsConfig


@dataclass
class ServiceSpec:
    name: str
    argv: list[str]
    address: str  # host:port answering grpc.health.v1
    health_service: str = ""
    start_timeout: float = 600.0
    restart_with: list[str] = field(default_factory=list)
    shm_patterns: list[str] = field(default_factory=list)  # e.g. /dev/shm/pagedserve-kv-{pid}-*
    env: dict[str, str] = field(default_factory=dict)
    tls: TlsConfig | None = None  # how to reach its health service
    stop_wave: int = 0  # stop() signals wave 0 first and waits for it before wave 1
    stop_grace: float | None = None  # seconds from SIGTERM to SIGKILL (None: the supervisor's grace)


class ServiceFailed(RuntimeError):
    pass


SUPERVISOR_PID_ENV = "PAGEDSERVE_SUPERVISOR_PID"


def die_with_supervisor() -> None:
    """In a child the supervisor started (the variable names its pid): get SIGTERM when it
    dies, or now if it already has. The variable is removed, so the child's own children
    are not bound to it."""
    pid = os.environ.pop(SUPERVISOR_PID_ENV, "")
    if not pid or sys.platform != "linux":
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() != int(pid):  # it died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def health_status(address: str, service: str = "", timeout: float = 1.0,
                  tls: TlsConfig | None = None) -> int | None:
    """The health status (health_pb2.HealthCheckResponse.*) or None when nothing answers."""
    with open_channel(address, tls) as channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout).status
        except grpc.RpcError:
            return None


class _Running:
    def __init__(self, spec: ServiceSpec):
        self.spec = spec
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0
        self.backoff = 0.5
        self.restart_at: float | None = None


class Supervisor:
    def __init__(self, services: list[ServiceSpec], log=None, grace: float = 10.0,
                 healthy_after: float = 30.0, max_backoff: float = 30.0):
        self.services = [_Running(s) for s in services]
        self.by_name = {r.spec.name: r for r in self.services}
        self.log = log or (lambda msg: print(f"pagedserve: {msg}", file=sys.stderr, flush=True))
        self.grace = grace
        self.healthy_after = healthy_after
        self.max_backoff = max_backoff
        self.pids: list[int] = []
        self._stop = threading.Event()

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: self.request_stop())

    def request_stop(self) -> None:
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def start(self) -> None:
        for r in self.services:
            if self.stopping:
                return
            self._spawn(r)
            self._wait_serving(r)

    def run(self, poll: float = 0.2) -> None:
        while not self._stop.wait(poll):
            now = time.monotonic()
            for r in self.services:
                if r.restart_at is None and r.proc is not None and r.proc.poll() is not None:
                    self._crashed(r, now)
            for r in self.services:
                if r.restart_at is not None and now >= r.restart_at and not self.stopping:
                    r.restart_at = None
                    self._spawn(r)
                    try:
                        self._wait_serving(r)
                    except ServiceFailed as e:
                        self.log(str(e))

    def stop(self) -> None:
        running = [r for r in reversed(self.services) if r.proc and r.proc.poll() is None]
        for wave in sorted({r.spec.stop_wave for r in running}):
            members = [r for r in running if r.spec.stop_wave == wave]
            for r in members:
                self._signal(r.proc, signal.SIGTERM)
            start = time.monotonic()
            for r in members:
                grace = self.grace if r.spec.stop_grace is None else r.spec.stop_grace
                self._wait_or_kill(r.proc, max(start + grace - time.monotonic(), 0.01), grace)
        self._remove_segments()

    def _wait_or_kill(self, p: subprocess.Popen, timeout: float, grace: float) -> None:
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            self.log(f"pid {p.pid} did not stop within {grace:.0f}s; killing it")
            self._signal(p, signal.SIGKILL)
            p.wait()

    def _crashed(self, r: _Running, now: float) -> None:
        code = r.proc.returncode
        if now - r.started_at > self.healthy_after:
            r.backoff = 0.5
        self.log(f"{r.spec.name} (pid {r.proc.pid}) exited with code {code}; "
                 f"restarting in {r.backoff:.1f}s")
        r.restart_at = now + r.backoff
        r.backoff = min(r.backoff * 2, self.max_backoff)
        for name in r.spec.restart_with:
            dep = self.by_name[name]
            if dep.proc is not None and dep.proc.poll() is None and dep.restart_at is None:
                self.log(f"restarting {name} with {r.spec.name}")
                self._signal(dep.proc, signal.SIGTERM)
                self._wait_or_kill(dep.proc, self.grace, self.grace)
                dep.restart_at = r.restart_at + 0.5
        self._remove_segments()

    def _spawn(self, r: _Running) -> None:
        env = {**os.environ, **r.spec.env, SUPERVISOR_PID_ENV: str(os.getpid())}
        r.proc = subprocess.Popen(r.spec.argv, env=env, process_group=0)
        r.started_at = time.monotonic()
        self.pids.append(r.proc.pid)

    def _wait_serving(self, r: _Running) -> None:
        deadline = time.monotonic() + r.spec.start_timeout
        while not self.stopping:
            if r.proc.poll() is not None:
                raise ServiceFailed(f"{r.spec.name} exited with code {r.proc.returncode} while starting")
            if health_status(r.spec.address, r.spec.health_service, tls=r.spec.tls) == health_pb2.HealthCheckResponse.SERVING:
                return
            if time.monotonic() > deadline:
                raise ServiceFailed(f"{r.spec.name} was not SERVING on {r.spec.address} "
                                    f"after {r.spec.start_timeout:.0f}s")
            self._stop.wait(0.2)

    def _signal(self, p: subprocess.Popen, sig: int) -> None:
        try:
            p.send_signal(sig)
        except ProcessLookupError:
            pass

    def _remove_segments(self) -> None:
        running = {r.proc.pid for r in self.services if r.proc and r.proc.poll() is None}
        for r in self.services:
            for pattern in r.spec.shm_patterns:
                for pid in self.pids:
                    if pid in running:
                        continue
                    for path in glob.glob(pattern.format(pid=pid)):
                        try:
                            os.unlink(path)
                            self.log(f"removed leftover shared memory {path}")
                        except FileNotFoundError:
                            pass
