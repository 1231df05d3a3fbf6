"""Faults at the edges, with real processes (memsvc, the model-free executor, a gateway):
a client killed mid-stream leaks nothing; SIGTERM drains the gateway gracefully; a
SIGKILLed gateway's blocks are freed by memsvc when its session lapses."""
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest

from pagedserve.wire.v1 import generation_pb2 as pb
from tests.support import ROOT
from tests.support.gateway_harness import collect, greedy
from tests.support.health import NOT_SERVING, wait_for_health
from tests.support.reliability_procs import scrape, serving_stack

LEASE = 4.0
CLIENT = """
import sys, time, grpc
from pagedserve.wire.v1 import generation_pb2 as pb, generation_pb2_grpc as pb_grpc
stub = pb_grpc.GenerationStub(grpc.insecure_channel(sys.argv[1]))
streams = [stub.Generate(pb.GenerateRequest(prompt=f"Count slowly, {i}:", sampling=pb.SamplingParams(
    max_tokens=1500, temperature=0, ignore_eos=True))) for i in range(8)]
for s in streams:
    next(s)
print("streaming", flush=True)
time.sleep(600)
"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with serving_stack(str(tmp_path_factory.mktemp("faults")), lease=LEASE,
                       executor_args=["--step-delay", "0.02"]) as s:
        yield s


def long_request(i: int, max_tokens: int = 1500) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=f"Tell a long story, part {i}.", sampling=greedy(max_tokens, ignore_eos=True))


def test_a_client_killed_mid_stream_leaks_nothing(stack):
    before = scrape(stack.ports["gateway_metrics"]).get('pagedserve:request_errors_total{code="CANCELLED"}', 0)
    client = subprocess.Popen([sys.executable, "-c", CLIENT, stack.gateway], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    try:
        assert client.stdout.readline().strip() == "streaming"
        assert stack.memsvc_stats().blocks_referenced > 0
        client.send_signal(signal.SIGKILL)
        client.wait(10)
    finally:
        client.kill()
    stats = stack.wait_unreferenced()
    assert (stats.blocks_referenced, stats.num_sequences) == (0, 0)
    deadline = time.monotonic() + 10
    while True:
        m = scrape(stack.ports["gateway_metrics"])
        cancelled = m.get('pagedserve:request_errors_total{code="CANCELLED"}', 0) - before
        if cancelled == 8 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert cancelled == 8
    assert m["pagedserve:num_requests_running"] == m["pagedserve:num_requests_waiting"] == 0


def test_sigterm_drains_running_streams_then_exits(stack):
    gateway = stack.procs["gateway"]
    streams = [stack.gen.Generate(long_request(i, 100), timeout=60) for i in range(3)]
    firsts = [next(s) for s in streams]
    gateway.kill(signal.SIGTERM)
    wait_for_health(stack.gateway, NOT_SERVING, "pagedserve.v1.Generation", timeout=5, interval=0.02)
    with pytest.raises(grpc.RpcError) as e:
        list(stack.gen.Generate(long_request(9, 4), timeout=10))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in e.value.details()
    for first, s in zip(firsts, streams):
        out = collect(s)
        assert out[0]["finish_reason"] == "length"
        assert len(first.token_ids) + len(out[0]["token_ids"]) == 100
    assert gateway.proc.wait(15) == 0
    assert stack.wait_unreferenced().blocks_referenced == 0
    gateway.start()
    stack.wait_serving()


def test_a_killed_gateway_has_its_blocks_freed_when_its_session_lapses(stack):
    streams = [stack.gen.Generate(long_request(i), timeout=60) for i in range(4)]
    for s in streams:
        next(s)
    held = stack.memsvc_stats()
    assert held.blocks_referenced > 0 and held.num_sessions >= 1
    stack.procs["gateway"].kill(signal.SIGKILL)
    for s in streams:
        with pytest.raises(grpc.RpcError) as e:
            list(s)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert stack.memsvc_stats().blocks_referenced > 0  # held until the lease runs out
    stats = stack.wait_unreferenced(timeout=LEASE + 5)
    assert (stats.blocks_referenced, stats.num_sequences, stats.num_sessions) == (0, 0, 0)
    assert "lapsed: freed 4 sequences" in stack.procs["memsvc"].output()
