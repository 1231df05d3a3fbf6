"""`pagedserve bench fuzz`: fuzz both public APIs of a real `pagedserve serve` and check
its invariants (RELIABILITY.md, "Fuzzing the running services").

    pagedserve bench fuzz --requests 5000 --seed 1
    pagedserve bench fuzz --server http://127.0.0.1:8000 --grpc 127.0.0.1:50051 --requests 500

Without --server it starts `pagedserve serve` (the default model) on free ports with
--kv-tokens and --max-num-seqs, its output in a log file next to --out, and stops it at the
end. The harness is pagedserve.benchmarks.fuzz_harness; the invariants (pagedserve.benchmarks.fuzz_report): no
5xx (nor unanswered request) for any input, every reference answer equal to its fresh
computation, no block or sequence held by memsvc after the run, /health answered 200 every
poll with a p99 under --health-p99-ms. Prints a summary, writes the report to --out, and
exits 1 when an invariant broke.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import subprocess
import sys
import time

from pagedserve.benchmarks.fuzz_inputs import WEIGHTS
from pagedserve.rpc.ports import free_port

# httpx (and the harness, which needs it) are imported where used: the command line builds
# every bench's parser, and the GPU path carries no httpx (scripts/gpu_not_carried.txt)

CLI = [sys.executable, "-m", "pagedserve.cli"]


def add_parser(sub) -> None:
    p = sub.add_parser(
        "fuzz", help="fuzz both APIs of a running `serve` and check its invariants",
        description="Send seeded hostile requests over the OpenAI HTTP API and gRPC (wrong types, "
                    "out-of-range numbers, unicode edge cases, huge and nested bodies, hostile "
                    "schemas, tools, beam and n extremes, disconnects) while greedy reference requests "
                    "run beside them and /health is polled; report every 5xx, every reference that "
                    "differs from a fresh computation, /health latency and the blocks left held.")
    p.add_argument("--requests", type=int, default=5000, help="fuzzed requests")
    p.add_argument("--seed", type=int, default=0, help="the run's seed: (seed, index) reproduces each request")
    p.add_argument("--concurrency", type=int, default=4, help="fuzzed requests in flight")
    p.add_argument("--server", default=None,
                   help="a running gateway's HTTP API, e.g. http://127.0.0.1:8000 (default: start serve)")
    p.add_argument("--grpc", default=None, help="with --server: its gRPC API (default: its host, port 50051)")
    p.add_argument("--categories", default=None,
                   help=f"comma-separated, only these kinds of request (of {', '.join(WEIGHTS)}; default: all)")
    p.add_argument("--kv-tokens", type=int, default=4096, help="the pool of the serve it starts")
    p.add_argument("--max-num-seqs", type=int, default=8, help="of the serve it starts")
    p.add_argument("--health-p99-ms", type=float, default=100.0, help="the bound on /health's p99")
    p.add_argument("--out", default="bench_results/fuzz.json", help="JSON results file")
    p.set_defaults(run=run)


@contextlib.contextmanager
def serving(kv_tokens: int, max_num_seqs: int, log_path: str):
    """`pagedserve serve` on free ports until /health says 200: (base_url, grpc_address)."""
    import httpx

    http_port, port = free_port(), free_port()
    args = [*CLI, "serve", "--port", str(port), "--http-port", str(http_port), "--kv-tokens", str(kv_tokens),
            "--max-num-seqs", str(max_num_seqs)]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, process_group=0)
    url = f"http://127.0.0.1:{http_port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"pagedserve bench fuzz: serve exited with {proc.returncode}; see {log_path}")
            if time.monotonic() > deadline:
                raise SystemExit(f"pagedserve bench fuzz: serve was not healthy after 300 s; see {log_path}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.5)
        yield url, f"127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def print_summary(report: dict, broken: list[str]) -> None:
    print(f"fuzz: {report['requests']} requests (seed {report['config']['seed']}) in {report['duration_s']} s")
    print("  outcomes: " + ", ".join(f"{k} {v}" for k, v in report["outcomes"].items()))
    for e in report["server_errors"][:20]:
        print(f"  SERVER ERROR #{e['index']} {e['category']}: {e['status']} {e['answer'][:160]}\n"
              f"      {e['request'][:300]}")
    refs = report["references"]
    print(f"  references: {refs['checked']} checked ({refs['by_kind']}), {refs['compared']} compared, "
          f"{refs['mismatch_count']} mismatches, {refs['error_count']} errors")
    for m in refs["mismatches"][:10]:
        print(f"  MISMATCH {m['api']} {m['kind']} prefix (after {m['after_probe'] or 'no probe'}): {m['cached']!r} != fresh {m['fresh']!r}")
    h = report["health"]
    print(f"  /health: {h['polls']} polls {h['statuses']}, p50 {h['p50_ms']} ms, p99 {h['p99_ms']} ms, "
          f"max {h['max_ms']} ms, {h['over_100ms']} over 100 ms")
    for s in h["notable"][:5]:
        print(f"    poll at {s['at_s']} s: {s['status']} in {s['ms']} ms, in flight {s['in_flight'][:6]}")
    print(f"  after the run: {report['after']}")
    print("  invariants: " + ("all hold" if not broken else "BROKEN: " + "; ".join(broken)))


def run(args) -> int:
    import httpx

    from pagedserve.benchmarks.fuzz_harness import FuzzConfig, run as run_fuzz
    from pagedserve.benchmarks.fuzz_report import violations

    categories = tuple(args.categories.split(",")) if args.categories else None
    if categories and not set(categories) <= set(WEIGHTS):
        raise SystemExit(f"pagedserve bench fuzz: --categories: unknown {set(categories) - set(WEIGHTS)}")
    cfg = FuzzConfig(requests=args.requests, seed=args.seed, concurrency=args.concurrency, categories=categories)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    if args.server:
        grpc_address = args.grpc or f"{httpx.URL(args.server).host}:50051"
        server = {"url": args.server, "grpc": grpc_address}
        report = run_fuzz(cfg, args.server, grpc_address, log)
    else:
        log_path = os.path.splitext(args.out)[0] + "-serve.log"
        server = {"started": "pagedserve serve", "kv_tokens": args.kv_tokens, "max_num_seqs": args.max_num_seqs,
                  "log": log_path}
        with serving(args.kv_tokens, args.max_num_seqs, log_path) as (url, grpc_address):
            report = run_fuzz(cfg, url, grpc_address, log)
    broken = violations(report, args.health_p99_ms)
    report.update(started_at=started, server=server, violations=broken)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print_summary(report, broken)
    print(f"  written to {args.out}")
    return 1 if broken else 0
