"""Faults in the backend under `pagedserve serve` (supervisor, real model, real processes):
SIGKILL the executor, then memsvc, while greedy requests generate; every request finishes
with exactly the tokens of a fault-free run, no block stays referenced, and the same
requests sent after the fault (their prompts now prefix-cache hits) give those tokens too."""
import os
import signal
import threading
import time

import grpc
import pytest

from pagedserve.wire.v1 import generation_pb2 as pb
from pagedserve.wire.v1 import memory_pb2
from tests.support.gateway_harness import greedy
from tests.support.reliability_procs import scrape
from tests.support.serve_procs import children, cmdline, free_port, serving_grpc

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def served():
    metrics = free_port()
    with serving_grpc("--kv-tokens", "2048", "--max-num-seqs", "8", "--metrics-port", str(metrics)) as served:
        yield dict(served, metrics=metrics)


def request(prompt: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=prompt, sampling=greedy(MAX_TOKENS, ignore_eos=True))


def tokens(stream) -> list[int]:
    return [t for r in stream for t in r.token_ids]


@pytest.fixture(scope="module")
def reference(served):
    return [tokens(served["stub"].Generate(request(p), timeout=120)) for p in PROMPTS]


def child(served, name: str) -> int:
    [pid] = [p for p in children(served["proc"].pid) if name in cmdline(p)]
    served["pids"].add(pid)
    return pid


def run_with_fault(served, fault) -> list[list[int]]:
    """Start every prompt, let each stream a token, inject `fault`, collect the rest."""
    streams = [served["stub"].Generate(request(p), timeout=300) for p in PROMPTS]
    firsts = [list(next(s).token_ids) for s in streams]
    start = time.monotonic()
    fault()
    out = [None] * len(streams)

    def drain(i):
        out[i] = firsts[i] + tokens(streams[i])

    threads = [threading.Thread(target=drain, args=(i,)) for i in range(len(streams))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    print(f"{len(streams)} requests finished {time.monotonic() - start:.1f}s after the fault")
    return out


def again(served) -> list[list[int]]:
    """The prompts once more, after the fault: a later request's output is still right."""
    return [tokens(served["stub"].Generate(request(p), timeout=120)) for p in PROMPTS]


def wait_unreferenced(served, timeout=30.0) -> int:
    deadline = time.monotonic() + timeout
    while True:
        try:
            n = served["memory"].Stats(memory_pb2.StatsRequest(), timeout=5).blocks_referenced
        except grpc.RpcError:
            n = -1
        if n == 0 or time.monotonic() > deadline:
            return n
        time.sleep(0.2)


def test_executor_sigkill_mid_generation_keeps_the_pool_and_the_outputs(served, reference):
    old = child(served, "executor")
    before = scrape(served["metrics"])
    got = run_with_fault(served, lambda: os.kill(old, signal.SIGKILL))
    assert got == reference
    after = scrape(served["metrics"])
    assert after['pagedserve:step_retries_total{call="execute"}'] > before['pagedserve:step_retries_total{call="execute"}']
    # the pool was kept: nothing was recomputed
    assert after['pagedserve:num_preemptions_total{mode="recompute"}'] == \
        before['pagedserve:num_preemptions_total{mode="recompute"}']
    assert child(served, "executor") != old
    assert wait_unreferenced(served) == 0
    assert again(served) == reference
    print("execute retries:", after['pagedserve:step_retries_total{call="execute"}']
          - before['pagedserve:step_retries_total{call="execute"}'])


def test_memsvc_sigkill_recreates_the_pool_and_recomputes(served, reference):
    old = child(served, "memsvc")
    before = scrape(served["metrics"])
    got = run_with_fault(served, lambda: os.kill(old, signal.SIGKILL))
    assert got == reference
    after = scrape(served["metrics"])
    recomputed = (after['pagedserve:num_preemptions_total{mode="recompute"}']
                  - before['pagedserve:num_preemptions_total{mode="recompute"}'])
    assert recomputed >= 1  # the running sequences came back for recompute
    assert child(served, "memsvc") != old
    assert wait_unreferenced(served) == 0
    assert again(served) == reference
    print("recomputed:", recomputed, "reserve retries:", after['pagedserve:step_retries_total{call="reserve"}']
          - before['pagedserve:step_retries_total{call="reserve"}'])
