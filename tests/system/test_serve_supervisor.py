"""The supervisor with stand-in services (a grpc health server each): start order, restarts,
stop with a kill -9 fallback, and removal of leftover shared-memory segments."""
import os
import signal
import sys
import threading
import time

from grpc_health.v1 import health_pb2

from pagedserve.serve_cmd import free_port
from pagedserve.supervisor import ServiceSpec, Supervisor, health_status

STANDIN = """
import os, signal, sys, time
from concurrent import futures
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
port, mode, log = sys.argv[1], sys.argv[2], sys.argv[3]
if mode == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
open(f"/dev/shm/pagedserve-test-{os.getpid()}", "w").close()
with open(log, "a") as f:
    f.write(f"{port} {os.getpid()}\\n")
server = grpc.server(futures.ThreadPoolExecutor(2))
h = health.HealthServicer()
health_pb2_grpc.add_HealthServicer_to_server(h, server)
server.add_insecure_port(f"127.0.0.1:{port}")
server.start()
h.set("", health_pb2.HealthCheckResponse.SERVING)
while True:
    time.sleep(1)
"""

SERVING = health_pb2.HealthCheckResponse.SERVING


def specs(tmp_path, modes=("normal", "normal")):
    log = tmp_path / "starts.log"
    out = []
    for i, mode in enumerate(modes):
        port = free_port()
        out.append(ServiceSpec(f"s{i}", [sys.executable, "-c", STANDIN, str(port), mode, str(log)],
                               f"127.0.0.1:{port}", start_timeout=30,
                               restart_with=[f"s{i + 1}"] if i + 1 < len(modes) else [],
                               shm_patterns=["/dev/shm/pagedserve-test-{pid}"]))
    return out, log


def starts(log):
    return [line.split() for line in log.read_text().splitlines()]


def gone(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_start_in_order_restart_and_stop(tmp_path):
    services, log = specs(tmp_path)
    messages = []
    sup = Supervisor(services, log=messages.append, grace=2.0)
    runner = None
    try:
        sup.start()
        assert [p for p, _ in starts(log)] == [services[0].address.split(":")[1],
                                             services[1].address.split(":")[1]]
        runner = threading.Thread(target=sup.run, kwargs={"poll": 0.05})
        runner.start()
        first = sup.by_name["s0"].proc.pid
        os.kill(first, signal.SIGKILL)  # s0 crashes; s1 restarts with it
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(starts(log)) < 4:
            time.sleep(0.1)
        assert len(starts(log)) == 4, messages
        while time.monotonic() < deadline and health_status(services[1].address) != SERVING:
            time.sleep(0.1)
        assert health_status(services[0].address) == SERVING
        assert any("s0" in m and "restarting" in m for m in messages)
        assert not os.path.exists(f"/dev/shm/pagedserve-test-{first}")
    finally:
        sup.request_stop()
        if runner:
            runner.join(10)
        sup.stop()
    assert all(gone(int(pid)) for _, pid in starts(log))
    assert not any(os.path.exists(f"/dev/shm/pagedserve-test-{pid}") for _, pid in starts(log))


def test_stop_kills_a_service_that_ignores_sigterm(tmp_path):
    services, log = specs(tmp_path, modes=("normal", "ignore-term"))
    messages = []
    sup = Supervisor(services, log=messages.append, grace=0.5)
    try:
        sup.start()
    finally:
        sup.stop()
    assert all(gone(int(pid)) for _, pid in starts(log))
    assert any("killing" in m for m in messages)
    assert not any(os.path.exists(f"/dev/shm/pagedserve-test-{pid}") for _, pid in starts(log))
