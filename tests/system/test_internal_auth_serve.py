"""Closed by default, through a real `pagedserve serve` (zero-cost executor) that makes its own
internal token: a local process that calls memsvc or the executor without it, or with
another, is refused UNAUTHENTICATED on every method (reflection too), health stays open, a
step-channel connection without the hello (or with a wrong token in it) is refused and
closed, and the served API works, its steps on the step channel."""
import os
import socket
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pagedserve.rpc import internal_auth, step_channel
from pagedserve.rpc.grpc_service import open_channel
from pagedserve.wire.v1 import (
    executor_pb2,
    executor_pb2_grpc,
    memory_pb2,
    memory_pb2_grpc,
)
from pagedserve.wire.v1 import generation_pb2 as pb
from pagedserve.wire.v1 import generation_pb2_grpc as pb_grpc
from tests.support import ROOT
from tests.support.gateway_harness import collect, greedy
from tests.support.serve_procs import children, cmdline, free_port, stop_serve

UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED


@pytest.fixture(scope="module")
def served():
    ports = {n: free_port() for n in ("gateway", "memsvc", "executor")}
    env = {k: v for k, v in os.environ.items() if k != internal_auth.ENV}  # serve makes one itself
    proc = subprocess.Popen([sys.executable, "-m", "pagedserve.cli", "serve", "--zero-cost",
                             "--port", str(ports["gateway"]), "--memsvc-port", str(ports["memsvc"]),
                             "--executor-port", str(ports["executor"]), "--http-port", "0",
                             "--kv-tokens", "1024"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True, process_group=0)
    try:
        assert proc.stdout.readline().startswith("pagedserve: serving"), "serve did not start"
        pids = {name: next(p for p in children(proc.pid) if name in cmdline(p)) for name in ("memsvc", "executor")}
        yield {name: f"127.0.0.1:{port}" for name, port in ports.items()}, pids
    finally:
        stop_serve(proc)


def internal_calls(memsvc: grpc.Channel, executor: grpc.Channel) -> dict:
    mem, ex = memory_pb2_grpc.MemoryManagerStub(memsvc), executor_pb2_grpc.ExecutorStub(executor)
    reflect = reflection_pb2_grpc.ServerReflectionStub(memsvc)
    return {
        "Reserve": lambda: mem.Reserve(memory_pb2.ReserveRequest(session_id="intruder"), timeout=10),
        "Free": lambda: mem.Free(memory_pb2.FreeRequest(session_id="intruder", seq_ids=["x"]), timeout=10),
        "Stats": lambda: mem.Stats(memory_pb2.StatsRequest(), timeout=10),
        "WatchBlocks": lambda: next(iter(mem.WatchBlocks(memory_pb2.WatchBlocksRequest(), timeout=10))),
        "RegisterExecutor": lambda: mem.RegisterExecutor(memory_pb2.RegisterExecutorRequest(), timeout=10),
        "Execute": lambda: ex.Execute(executor_pb2.ExecuteRequest(session_id="intruder"), timeout=10),
        "ModelInfo": lambda: ex.ModelInfo(executor_pb2.ModelInfoRequest(), timeout=10),
        "reflection": lambda: list(reflect.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)),
    }


@pytest.mark.parametrize("token", [None, "a-token-that-is-not-the-one-serve-made"])
def test_every_internal_method_refuses_a_caller_without_the_token(served, token):
    addresses, _ = served
    with open_channel(addresses["memsvc"], token=token) as m, open_channel(addresses["executor"], token=token) as e:
        for name, call in internal_calls(m, e).items():
            with pytest.raises(grpc.RpcError) as refused:
                call()
            assert refused.value.code() == UNAUTHENTICATED, name
            assert "--internal-token" in refused.value.details(), name
        for channel in (m, e):  # probes need no secret
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.SERVING


def listening_ports(pid: int) -> set[int]:
    """The TCP ports process `pid` listens on (its socket inodes matched in /proc/net/tcp)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in list(f)[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def step_port(pid: int, grpc_port: int) -> int:
    """The one port `pid` listens on besides its gRPC port (and metrics port): its step channel."""
    argv = cmdline(pid)
    metrics = {int(argv[argv.index("--metrics-port") + 1])} if "--metrics-port" in argv else set()
    [port] = listening_ports(pid) - {grpc_port} - metrics
    return port


def first_answer(port: int, frame: bytes) -> int:
    """The status of the first answer to `frame` on a new connection, which must then close."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(frame)
        status, _ = step_channel.read_hello(sock)
        try:
            assert sock.recv(1) == b""
        except ConnectionResetError:  # closed with the rest of `frame` unread
            pass
    return status


def established_to(port: int) -> bool:
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            if any(int(line.split()[2].rsplit(":", 1)[1], 16) == port and line.split()[3] == "01"
                   for line in list(f)[1:]):
                return True
    return False


def test_the_step_channel_refuses_a_connection_without_the_hello_and_the_api_works_over_it(served):
    addresses, pids = served
    channel = grpc.insecure_channel(addresses["gateway"])
    out = collect(pb_grpc.GenerationStub(channel).Generate(
        pb.GenerateRequest(prompt="The capital of France is", sampling=greedy(6, ignore_eos=True)), timeout=60))
    channel.close()
    assert len(out[0]["token_ids"]) == 6 and out[0]["finish_reason"] == "length"
    reserve = memory_pb2.ReserveRequest(session_id="intruder").SerializeToString()
    execute = executor_pb2.ExecuteRequest(session_id="intruder").SerializeToString()
    for name, payload, method in (("memsvc", reserve, "Reserve"), ("executor", execute, "Execute")):
        port = step_port(pids[name], int(addresses[name].rsplit(":", 1)[1]))
        deadline = time.monotonic() + 10
        while not established_to(port) and time.monotonic() < deadline:  # the gateway's, with the token
            time.sleep(0.1)
        assert established_to(port), f"the gateway holds no step channel to {name}"
        call = step_channel.HEADER.pack(len(payload), 1, step_channel.METHODS[method]) + payload
        assert first_answer(port, call + call) == UNAUTHENTICATED.value[0], name
        wrong = b"x" * 43
        hello = step_channel.HEADER.pack(len(wrong), 0, step_channel.HELLO) + wrong
        assert first_answer(port, hello + call) == UNAUTHENTICATED.value[0], name
