"""Closed by default: with mutual TLS, real memsvc and executor processes accept each method
only from callers whose certificate names the right role (pagedserve.rpc.peer_auth); RegisterExecutor
and Execute from anyone else are refused. The executor is checked before its model loads
(the role check comes before everything else), so no step runs."""
import os
import signal
import subprocess
import sys

import grpc
import pytest

from pagedserve.rpc.ports import free_port
from pagedserve.wire.v1 import (
    executor_pb2,
    executor_pb2_grpc,
    memory_pb2,
    memory_pb2_grpc,
)
from tests.support import ROOT
from tests.support.certs import make_cert_dir, tls_args
from tests.support.health import NOT_SERVING, SERVING, wait_for_health

REFUSED = (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED)


def pem(path):
    with open(path, "rb") as f:
        return f.read()


def creds(certs, name=None):
    if name is None:  # TLS, but no client certificate
        return grpc.ssl_channel_credentials(root_certificates=pem(certs["ca"]))
    cert, key = certs[name]
    return grpc.ssl_channel_credentials(root_certificates=pem(certs["ca"]), private_key=pem(key),
                                        certificate_chain=pem(cert))


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    d = tmp_path_factory.mktemp("peer_auth")
    certs = make_cert_dir(d, {"memsvc": ("memsvc",), "executor": ("executor",),
                              "gateway": ("gateway",), "nobody": ()})
    memsvc, executor = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    health_port = free_port()
    procs = []

    def start(name, *args):
        log = open(d / f"{name}.log", "w")
        procs.append(subprocess.Popen([sys.executable, "-m", "pagedserve.cli", *args], cwd=ROOT,
                                      stdout=log, stderr=subprocess.STDOUT, process_group=0))
        return procs[-1]

    try:
        m = start("memsvc", "memsvc", "--port", memsvc.split(":")[1], "--kv-tokens", "256",
                  "--health-port", str(health_port), *tls_args(certs, "memsvc"))
        # An executor whose own registration is refused would stop: point it at no memsvc, and
        # give it long enough to answer the calls below while it keeps trying.
        e = start("executor", "executor", "--port", executor.split(":")[1], "--memsvc",
                  f"127.0.0.1:{free_port()}", "--register-timeout", "300", *tls_args(certs, "executor"))
        wait_for_health(memsvc, SERVING, proc=m, timeout=60, tls=creds(certs, "gateway"))
        wait_for_health(executor, NOT_SERVING, proc=e, timeout=120, tls=creds(certs, "gateway"))
        yield certs, memsvc, executor, health_port
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def call(address, credentials, fn):
    with grpc.secure_channel(address, credentials) as channel:
        try:
            fn(channel)
        except grpc.RpcError as e:
            return e.code()
    return grpc.StatusCode.OK


def register(channel):
    memory_pb2_grpc.MemoryManagerStub(channel).RegisterExecutor(
        memory_pb2.RegisterExecutorRequest(geometry=memory_pb2.KVGeometry(dtype="int7")), timeout=10)


def reserve(channel):
    memory_pb2_grpc.MemoryManagerStub(channel).Reserve(memory_pb2.ReserveRequest(session_id="s"),
                                                       timeout=10)


def execute(channel):
    executor_pb2_grpc.ExecutorStub(channel).Execute(executor_pb2.ExecuteRequest(), timeout=10)


def test_register_executor_only_from_an_executor(services):
    certs, memsvc, _, _ = services
    for name in ("gateway", "nobody", "memsvc"):
        assert call(memsvc, creds(certs, name), register) in REFUSED, name
    # The executor's certificate gets through to the method (which refuses the bad geometry).
    assert call(memsvc, creds(certs, "executor"), register) == grpc.StatusCode.INVALID_ARGUMENT
    # No certificate, or one from another CA: the handshake itself fails.
    for credentials in (creds(certs), creds(certs, "rogue")):
        assert call(memsvc, credentials, register) == grpc.StatusCode.UNAVAILABLE


def test_reserve_only_from_a_gateway(services):
    certs, memsvc, _, _ = services
    for name in ("executor", "nobody"):
        assert call(memsvc, creds(certs, name), reserve) in REFUSED, name
    # A gateway gets through: no pool yet (no executor registered), so UNAVAILABLE from memsvc.
    assert call(memsvc, creds(certs, "gateway"), reserve) == grpc.StatusCode.UNAVAILABLE


def test_execute_only_from_a_gateway(services):
    certs, _, executor, _ = services
    for name in ("executor", "memsvc", "nobody"):
        assert call(executor, creds(certs, name), execute) in REFUSED, name
    # A gateway gets through to the method: the model is still loading (UNAVAILABLE).
    assert call(executor, creds(certs, "gateway"), execute) == grpc.StatusCode.UNAVAILABLE
    for credentials in (creds(certs), creds(certs, "rogue")):
        assert call(executor, credentials, execute) == grpc.StatusCode.UNAVAILABLE


def test_the_plaintext_health_port_answers_health_and_nothing_else(services):
    _, _, _, health_port = services
    address = f"127.0.0.1:{health_port}"
    wait_for_health(address, SERVING, timeout=10)
    with grpc.insecure_channel(address) as channel:
        with pytest.raises(grpc.RpcError) as e:
            reserve(channel)
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
