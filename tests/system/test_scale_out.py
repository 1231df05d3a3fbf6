"""Scale-out with real processes and the default model: 1 gateway with 2 replicas, and 2
gateways sharing 1 replica. Greedy output identical to the in-process engine; prefix-aware
routing beats round-robin on prefix-cache hits; a replica or a gateway killed mid-run."""
import glob
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from types import SimpleNamespace

import grpc
import pytest

from pagedserve.wire.protocol import SamplingParams
from pagedserve.wire.v1 import generation_pb2 as pb
from pagedserve.wire.v1 import generation_pb2_grpc as pb_grpc
from pagedserve.wire.v1 import memory_pb2, memory_pb2_grpc
from tests.support import ROOT
from tests.support.gateway_harness import collect, greedy
from tests.support.health import SERVING, wait_for_health
from tests.support.serve_procs import TOKEN, TOKEN_ENV, free_port
from pagedserve.rpc.grpc_service import open_channel

GENERATION = "pagedserve.v1.Generation"
KV_TOKENS = 4096
LEASE = 2.0
PROMPTS = ["The capital of France is", "Write a haiku about rain.", "1, 2, 3, 4,",
           "def fibonacci(n):", "Once upon a time", "The best way to learn is",
           "Q: What is 7 times 8?\nA:", "Hello, my name is"]


class Procs:
    """`pagedserve` commands in their own process groups, stderr to log files, every one given
    the internal TOKEN; stop() kills all."""

    def __init__(self, log_dir):
        self.log_dir, self.procs = log_dir, {}

    def start(self, name, *args):
        log = open(os.path.join(self.log_dir, f"{name}.log"), "w")
        self.procs[name] = subprocess.Popen([sys.executable, "-m", "pagedserve.cli", *args], cwd=ROOT,
                                            stdout=log, stderr=subprocess.STDOUT, process_group=0,
                                            env=dict(os.environ, **{TOKEN_ENV: TOKEN}))
        return self.procs[name]

    def log(self, name):
        with open(os.path.join(self.log_dir, f"{name}.log")) as f:
            return f.read()

    def kill(self, name):
        p = self.procs[name]
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        for path in glob.glob(f"/dev/shm/pagedserve-kv-{p.pid}-*"):  # a SIGKILLed memsvc cannot unlink
            os.unlink(path)

    def stop(self):
        for p in self.procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for p in self.procs.values():
            try:
                p.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def start_replica(procs, i, *memsvc_args, executor_args=()):
    memsvc, executor = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    procs.start(f"memsvc{i}", "memsvc", "--port", memsvc.split(":")[1], "--kv-tokens", str(KV_TOKENS),
                *memsvc_args)
    wait_for_health(memsvc, SERVING, proc=procs.procs[f"memsvc{i}"], timeout=60,
                    log=lambda: procs.log(f"memsvc{i}"))
    procs.start(f"executor{i}", "executor", "--port", executor.split(":")[1], "--memsvc", memsvc,
                *executor_args)
    return memsvc, executor


def start_gateway(procs, name, replicas, *extra):
    address = f"127.0.0.1:{free_port()}"
    args = [a for m, e in replicas for a in ("--replica", f"{m},{e}")]
    procs.start(name, "gateway", "--port", address.split(":")[1], *args, "--http-port", "0",
                "--max-num-seqs", "16", *extra)
    return address


def wait_all(procs, gateways):
    for name, address in gateways.items():
        wait_for_health(address, SERVING, GENERATION, procs.procs[name], timeout=300,
                        log=lambda: procs.log(name))


def stub(address):
    return pb_grpc.GenerationStub(grpc.insecure_channel(address))


def stats(memsvc):
    with open_channel(memsvc, token=TOKEN) as channel:
        return memory_pb2_grpc.MemoryManagerStub(channel).Stats(memory_pb2.StatsRequest(), timeout=10)


def run_all(jobs):
    """Run `jobs` (callables) concurrently; their results (or exceptions) in order."""
    results = [None] * len(jobs)

    def run(i):
        try:
            results[i] = jobs[i]()
        except Exception as e:  # reported by the test's assertions
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return results


def generate(address, prompt, max_tokens):
    return lambda: collect(stub(address).Generate(
        pb.GenerateRequest(prompt=prompt, sampling=greedy(max_tokens)), timeout=300))


def assert_same(engine_outputs, results):
    for want, got in zip(engine_outputs, results):
        assert not isinstance(got, Exception), got
        c = want.completions[0]
        assert got[0]["token_ids"] == c.token_ids
        assert got[0]["text"] == c.text
        assert got[0]["finish_reason"] == c.finish_reason


@pytest.fixture(scope="module")
def engine():
    from pagedserve.engine import LLMEngine

    return LLMEngine(kv_tokens=KV_TOKENS, max_num_seqs=16)


@pytest.fixture(scope="module")
def two_replicas(tmp_path_factory):
    """Two replicas; gateway `prefix` (prefix-aware routing) and `rr` (round-robin) on both."""
    procs = Procs(str(tmp_path_factory.mktemp("two_replicas")))
    try:
        replicas = [start_replica(procs, i) for i in range(2)]
        gateways = {"prefix": start_gateway(procs, "prefix", replicas),
                    "rr": start_gateway(procs, "rr", replicas, "--routing", "round-robin")}
        wait_all(procs, gateways)
        yield SimpleNamespace(procs=procs, replicas=replicas, gateways=gateways)
    finally:
        procs.stop()


def test_one_gateway_two_replicas_matches_the_engine(two_replicas, engine):
    prompts = PROMPTS * 2
    expected = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0))
    results = run_all([generate(two_replicas.gateways["prefix"], p, 8) for p in prompts])
    assert_same(expected, results)
    routed = two_replicas.procs.log("prefix")
    assert "replica r0 up" in routed and "replica r1 up" in routed


def shared_prefix_workload(tag: str, seed: int) -> list[str]:
    """8 shared prefixes (about 50 tokens each) x 4 questions, in a shuffled order."""
    prompts = [f"[{tag} system {k}] You are assistant number {k}. Answer in one short, precise "
               f"sentence, without preamble, and never repeat the question. Topic {k}: "
               f"question {q}?" for k in range(8) for q in range(4)]
    random.Random(seed).shuffle(prompts)
    return prompts


def hit_rate(replicas, run) -> float:
    before = [stats(m) for m, _ in replicas]
    run()
    after = [stats(m) for m, _ in replicas]
    hits = sum(a.prefix_cache_hits - b.prefix_cache_hits for a, b in zip(after, before))
    queries = sum(a.prefix_cache_queries - b.prefix_cache_queries for a, b in zip(after, before))
    return hits / queries


def test_prefix_aware_routing_hits_the_prefix_cache_more_than_round_robin(two_replicas):
    def workload(gateway, prompts):
        def run():
            for i in range(0, len(prompts), 4):  # 4 at a time
                results = run_all([generate(gateway, p, 2) for p in prompts[i:i + 4]])
                assert all(not isinstance(r, Exception) for r in results), results
        return run

    g = two_replicas.gateways
    rr = hit_rate(two_replicas.replicas, workload(g["rr"], shared_prefix_workload("rr", 1)))
    prefix = hit_rate(two_replicas.replicas, workload(g["prefix"], shared_prefix_workload("px", 1)))
    print(f"prefix-cache hit rate: prefix-aware {prefix:.3f}, round-robin {rr:.3f}")
    assert prefix > rr + 0.05


def test_killing_one_of_two_replicas_mid_run_loses_no_request(two_replicas, engine):
    prompts = [f"Story {i}: once upon a time, in a land far away," for i in range(6)]
    expected = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0))
    gateway = two_replicas.gateways["prefix"]
    jobs = [generate(gateway, p, 24) for p in prompts]
    results = [None]

    r1_memsvc = two_replicas.replicas[1][0]
    deadline = time.monotonic() + 30
    while stats(r1_memsvc).num_sequences and time.monotonic() < deadline:  # earlier tests' gone
        time.sleep(0.1)
    runner = threading.Thread(target=lambda: results.__setitem__(0, run_all(jobs)))
    runner.start()
    # Kill r1 while it provably holds running sequences (memsvc's count), not after a guess.
    deadline = time.monotonic() + 300
    while stats(r1_memsvc).num_sequences == 0:
        assert runner.is_alive() and time.monotonic() < deadline, "replica r1 never ran a sequence"
        time.sleep(0.02)
    two_replicas.procs.kill("executor1")
    two_replicas.procs.kill("memsvc1")
    runner.join(300)
    assert_same(expected, results[0])
    log = two_replicas.procs.log("prefix")
    moved = re.search(r"replica r1 down \(.*\): moving (\d+) requests", log)
    assert moved and int(moved.group(1)) > 0, "no request was moved: failover not exercised"
    assert log.count("moves to replica r0") >= int(moved.group(1))


@pytest.fixture(scope="module")
def two_gateways(tmp_path_factory):
    """One replica (session lease 2 s) driven by gateways `a` and `b`."""
    procs = Procs(str(tmp_path_factory.mktemp("two_gateways")))
    try:
        metrics_port = free_port()
        replica = start_replica(procs, 0, "--session-lease", str(LEASE),
                                executor_args=("--metrics-port", str(metrics_port)))
        gateways = {name: start_gateway(procs, name, [replica]) for name in ("a", "b")}
        wait_all(procs, gateways)
        yield SimpleNamespace(procs=procs, memsvc=replica[0], gateways=gateways,
                              executor_metrics=f"http://127.0.0.1:{metrics_port}/metrics")
    finally:
        procs.stop()


def test_two_gateways_share_one_replica_and_match_the_engine(two_gateways, engine):
    prompts = PROMPTS * 2
    expected = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0))
    names = ["a", "b"] * len(PROMPTS)
    results = run_all([generate(two_gateways.gateways[n], p, 8) for n, p in zip(names, prompts)])
    assert_same(expected, results)
    assert stats(two_gateways.memsvc).num_sessions == 2
    with urllib.request.urlopen(two_gateways.executor_metrics, timeout=10) as response:
        text = response.read().decode()
    merged = [line for line in text.splitlines() if line.startswith("pagedserve:execute_merged_calls_total")]
    assert float(merged[0].split()[-1]) > 0  # the two gateways' steps shared forward passes


def test_a_gateway_that_dies_loses_only_its_own_requests(two_gateways, engine):
    prompts = [f"Chapter {i}. It was a dark and stormy night;" for i in range(4)]
    expected = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0))
    g = two_gateways.gateways
    streaming = threading.Semaphore(0)

    def long_on_b(prompt):  # mid-run once its first token came: 500 more to go when b is killed
        def run():
            stream = stub(g["b"]).Generate(pb.GenerateRequest(
                prompt=prompt, sampling=greedy(512, ignore_eos=True)), timeout=300)
            for _ in stream:
                streaming.release()
                break
            return collect(stream)
        return run

    jobs = [generate(g["a"], p, 24) for p in prompts] + [long_on_b(p) for p in prompts]
    results = [None]
    runner = threading.Thread(target=lambda: results.__setitem__(0, run_all(jobs)))
    runner.start()
    for _ in prompts:
        assert streaming.acquire(timeout=120), "gateway b's requests never started streaming"
    two_gateways.procs.kill("b")
    runner.join(300)
    assert_same(expected, results[0][:4])
    assert all(isinstance(r, grpc.RpcError) for r in results[0][4:])
    deadline = time.monotonic() + LEASE + 10
    while time.monotonic() < deadline:
        s = stats(two_gateways.memsvc)
        if s.num_sessions == 1 and s.num_sequences == 0 and s.blocks_referenced == 0:
            break
        time.sleep(0.2)
    assert (s.num_sessions, s.num_sequences, s.blocks_referenced) == (1, 0, 0)
