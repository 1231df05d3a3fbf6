"""The supervisor with stand-in services (a grpc health server each): start order, restarts,
stop with a kill -9 fallback, and removal of leftover shared-memory segments."""
import os
import signal
import sys
import threading
import time

from grpc_health.v1 import health_pb2

from pagedserve.rpc.ports import free_port
from pagedserve.supervisor import ServiceSpec, Supervisor, health_status

SUPERVISED = """
import pickle, sys, time
from pagedserve.supervisor import Supervisor
sup = Supervisor(pickle.loads(bytes.fromhex(sys.argv[1])), log=print)
sup.start()
print("started", flush=True)
time.sleep(600)
"""

STANDIN = """
import os, signal, sys, time
from concurrent import futures
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from pagedserve.supervisor import SUPERVISOR_PID_ENV, die_with_supervisor
port, mode, log = sys.argv[1], sys.argv[2], sys.argv[3]
die_with_supervisor()
assert SUPERVISOR_PID_ENV not in os.environ  # a service's own children are not bound to it
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


def test_a_service_gets_sigterm_when_its_supervisor_is_killed(tmp_path):
    """PR_SET_PDEATHSIG, set by the service itself after exec (no Python runs between fork
    and exec in the supervisor's child)."""
    import pickle
    import subprocess

    services, log = specs(tmp_path, modes=("normal",))
    parent = subprocess.Popen([sys.executable, "-c", SUPERVISED, pickle.dumps(services).hex()],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline().strip() == "started"
        (_, pid), = starts(log)
        assert not gone(int(pid))
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not gone(int(pid)):
            time.sleep(0.05)
        assert gone(int(pid))
    finally:
        parent.kill()
        for _, pid in starts(log):
            if not gone(int(pid)):
                os.kill(int(pid), signal.SIGKILL)
        for _, pid in starts(log):
            if os.path.exists(f"/dev/shm/pagedserve-test-{pid}"):
                os.unlink(f"/dev/shm/pagedserve-test-{pid}")
