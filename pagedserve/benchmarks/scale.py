"""Scale-out measurements (BENCHMARKS.md "Scale-out"): prefix-aware vs round-robin routing,
1 vs 2 replicas, on loopback with the default model.

Starts two replicas (memsvc + executor) and three gateways: prefix-aware and round-robin
on both replicas, and one on replica 0 only. Each run uses its own prompts (a new tag),
so no run finds another's blocks cached. The services take a fresh internal token, which
this process also uses to read memsvc's counters.

    python -m pagedserve.benchmarks.scale [--kv-tokens 4096] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import grpc

from pagedserve.memsvc.config import MemoryConfig
from pagedserve.rpc.ports import free_port
from pagedserve.supervisor import health_status
from pagedserve.rpc.grpc_service import open_channel
from pagedserve.rpc.internal_auth import ENV as TOKEN_ENV
from pagedserve.rpc.internal_auth import new_token
from pagedserve.wire.v1 import generation_pb2 as pb
from pagedserve.wire.v1 import generation_pb2_grpc as pb_grpc
from pagedserve.wire.settings import add_flags
from pagedserve.wire.v1 import memory_pb2, memory_pb2_grpc

CLI = [sys.executable, "-m", "pagedserve.cli"]
SERVING = 1


def shared_prefix_prompts(tag: str, prefixes: int = 8, per_prefix: int = 8, seed: int = 0) -> list[str]:
    prompts = [f"[{tag} system {k}] You are assistant number {k}. Answer in one short, precise "
               f"sentence, without preamble, and never repeat the question. Topic {k}: "
               f"question {q}?" for k in range(prefixes) for q in range(per_prefix)]
    random.Random(seed).shuffle(prompts)
    return prompts


def run_load(address: str, prompts: list[str], max_tokens: int, concurrency: int) -> dict:
    """Closed loop: `concurrency` clients; TTFT per request, output tokens per second."""
    stub = pb_grpc.GenerationStub(grpc.insecure_channel(address))
    ttft, tokens, lock, queue = [], [0], threading.Lock(), list(enumerate(prompts))

    def client():
        while True:
            with lock:
                if not queue:
                    return
                _, prompt = queue.pop(0)
            start = time.perf_counter()
            first = None
            n = 0
            for r in stub.Generate(pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(
                    max_tokens=max_tokens, temperature=0.0, ignore_eos=True)), timeout=600):
                if first is None and r.token_ids:
                    first = time.perf_counter() - start
                n += len(r.token_ids)
            with lock:
                ttft.append(first)
                tokens[0] += n

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - start
    ttft.sort()
    return {"requests": len(prompts), "seconds": round(seconds, 2),
            "output_tokens_per_s": round(tokens[0] / seconds, 1),
            "ttft_mean_s": round(statistics.mean(ttft), 3),
            "ttft_p50_s": round(ttft[len(ttft) // 2], 3), "ttft_p90_s": round(ttft[int(len(ttft) * 0.9)], 3)}


def pool_counters(memsvcs: list[str], token: str) -> tuple[int, int]:
    hits = queries = 0
    for m in memsvcs:
        with open_channel(m, token=token) as channel:
            s = memory_pb2_grpc.MemoryManagerStub(channel).Stats(memory_pb2.StatsRequest(), timeout=10)
        hits, queries = hits + s.prefix_cache_hits, queries + s.prefix_cache_queries
    return hits, queries


def measured(memsvcs, token, address, prompts, max_tokens, concurrency) -> dict:
    h0, q0 = pool_counters(memsvcs, token)
    result = run_load(address, prompts, max_tokens, concurrency)
    h1, q1 = pool_counters(memsvcs, token)
    result["prefix_hit_rate"] = round((h1 - h0) / max(q1 - q0, 1), 3)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_flags(p, MemoryConfig, only={"kv_tokens"}, defaults={"kv_tokens": 4096})
    p.add_argument("--json", default=None)
    p.add_argument("--sections", default="routing,replicas,gateways",
                   help="comma-separated: routing, replicas, gateways (default: all)")
    args = p.parse_args(argv)
    sections = set(args.sections.split(","))
    logs = tempfile.mkdtemp(prefix="bench-scale-")
    procs = []
    token = new_token()

    def start(name, *a):
        out = open(os.path.join(logs, name + ".log"), "w")
        procs.append(subprocess.Popen([*CLI, *a], stdout=out, stderr=subprocess.STDOUT, process_group=0,
                                      env=dict(os.environ, **{TOKEN_ENV: token})))

    def wait(address, service=""):
        while health_status(address, service) != SERVING:
            time.sleep(0.2)

    try:
        replicas = []
        for i in range(2):
            m, e = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
            start(f"memsvc{i}", "memsvc", "--port", m.split(":")[1], "--kv-tokens", str(args.kv_tokens))
            wait(m)
            start(f"executor{i}", "executor", "--port", e.split(":")[1], "--memsvc", m)
            replicas.append((m, e))
        gateways = {}
        for name, reps, routing in (("prefix", replicas, "prefix"), ("rr", replicas, "round-robin"),
                                    ("one", replicas[:1], "prefix"), ("one-b", replicas[:1], "prefix")):
            address = f"127.0.0.1:{free_port()}"
            start(f"gateway-{name}", "gateway", "--port", address.split(":")[1], "--http-port", "0",
                  "--routing", routing, *[x for m, e in reps for x in ("--replica", f"{m},{e}")])
            gateways[name] = address
        for address in gateways.values():
            wait(address, "pagedserve.v1.Generation")
        memsvcs = [m for m, _ in replicas]
        run_load(gateways["one"], ["warm up"] * 2, 4, 2)
        results = {"routing": {}, "replicas": {}, "gateways": {}}
        for name in ("rr", "prefix") if "routing" in sections else ():
            results["routing"][name] = measured(memsvcs, token, gateways[name],
                                                shared_prefix_prompts(name), 16, 8)
            print(name, results["routing"][name], flush=True)
        distinct = [f"Request {i}: write a short story about the number {i * 7}." for i in range(32)]
        for name in ("one", "rr") if "replicas" in sections else ():
            results["replicas"][name] = measured(memsvcs, token, gateways[name],
                                                 [f"({name}) {d}" for d in distinct], 32, 16)
            print(name, results["replicas"][name], flush=True)
        if "gateways" in sections:  # one replica: 16 clients on one gateway, or 8 on each of two
            results["gateways"]["1"] = run_load(gateways["one"], [f"(g1) {d}" for d in distinct], 32, 16)
            print("1 gateway", results["gateways"]["1"], flush=True)
            halves = [{}, {}]
            threads = [threading.Thread(target=lambda i=i: halves[i].update(run_load(
                gateways[("one", "one-b")[i]], [f"(g2 {i}) {d}" for d in distinct[i::2]], 32, 8)))
                for i in range(2)]
            start = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            seconds = time.perf_counter() - start
            results["gateways"]["2"] = {
                "seconds": round(seconds, 2), "output_tokens_per_s": round(32 * 32 / seconds, 1),
                "ttft_mean_s": round((halves[0]["ttft_mean_s"] + halves[1]["ttft_mean_s"]) / 2, 3)}
            print("2 gateways", results["gateways"]["2"], flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(main())
