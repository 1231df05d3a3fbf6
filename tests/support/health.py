"""The one gRPC health probe of the tests: `health` asks once, `wait_for_health` polls until
a status is reached and fails loudly (with the process's output) if the process dies first."""
from __future__ import annotations

import subprocess
import time
from typing import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def health(address: str, service: str = "", tls: grpc.ChannelCredentials | None = None,
           timeout: float = 1.0) -> int | None:
    """The health status of `service` at `address` (health_pb2.HealthCheckResponse.*), or None
    when nothing answers. `tls`: channel credentials for a TLS listener (plaintext without)."""
    channel = grpc.secure_channel(address, tls) if tls else grpc.insecure_channel(address)
    with channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout).status
        except grpc.RpcError:
            return None


def _output(proc, log: str | Callable[[], str] | None, limit: int = 3000) -> str:
    """What the process wrote: `log()`, the file at `log`, or its unread stdout pipe."""
    try:
        if callable(log):
            text = log()
        elif log is not None:
            with open(log, "rb") as f:
                text = f.read().decode(errors="replace")
        elif proc is not None and proc.stdout is not None and proc.poll() is not None:
            text = proc.stdout.read()
            text = text.decode(errors="replace") if isinstance(text, bytes) else text
        else:
            return ""
    except (OSError, ValueError):
        return ""
    return "\n" + text[-limit:] if text else ""


def wait_for_health(address: str, status: int = SERVING, service: str = "",
                    proc: subprocess.Popen | None = None, timeout: float = 120.0, *,
                    tls: grpc.ChannelCredentials | None = None, name: str | None = None,
                    log: str | Callable[[], str] | None = None, seen: list | None = None,
                    interval: float = 0.1) -> None:
    """Poll `address` until `service` reports `status`. Raises RuntimeError with the output of
    `proc` (from `log`, a path or a callable, or its stdout pipe) as soon as `proc` has exited,
    and TimeoutError after `timeout` seconds. `seen`, if given, collects each distinct status
    answered in turn (None, no answer, left out)."""
    name = name or (" ".join(map(str, proc.args)) if proc is not None and isinstance(proc.args, list)
                    else str(getattr(proc, "args", address)))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}{_output(proc, log)}")
        now = health(address, service, tls)
        if seen is not None and now is not None and (not seen or seen[-1] != now):
            seen.append(now)
        if now == status:
            return
        time.sleep(interval)
    raise TimeoutError(f"{name} at {address} did not reach health status {status} "
                       f"in {timeout:.0f}s{_output(proc, log)}")


__all__ = ["NOT_SERVING", "SERVING", "health", "wait_for_health"]
