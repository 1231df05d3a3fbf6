"""`pagedserve bench serve`: a load generator over the public gRPC API."""
from __future__ import annotations

import asyncio
import json
import math
import os
import random
import time

from pagedserve.benchmarks.serve_metrics import RequestTiming, summarize
from pagedserve.benchmarks.workloads import (
    WORKLOADS,
    load_trace,
    poisson_arrivals,
    sample_lengths,
)


async def _one(stub, pb, req, prompt_ids, timing: RequestTiming, vocab_cap: int) -> None:
    import grpc

    sp = pb.SamplingParams(max_tokens=req.output_len, temperature=0.0, ignore_eos=True)
    msg = pb.GenerateRequest(sampling=sp)
    if req.prompt is not None:
        msg.prompt = req.prompt
    else:
        msg.prompt_token_ids.extend(prompt_ids)
    timing.start = time.perf_counter()
    try:
        async for r in stub.Generate(msg):
            now = time.perf_counter()
            for _ in r.token_ids:
                timing.token_times.append(now)
            timing.output_tokens += len(r.token_ids)
    except grpc.aio.AioRpcError as e:
        timing.status = e.code().name
    timing.end = time.perf_counter()


def prompt_token_ids(requests, *, seed: int = 0, vocab: int = 32000) -> list[list[int]]:
    """The random prompt ids run_load sends for `requests` (drawn in [100, vocab) from `seed`):
    what a peer served the same requests is given."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(r.prompt_len)] for r in requests]


async def run_load(server: str, requests, *, seed: int = 0, vocab: int = 32000,
                   progress: bool = True, time_limit: float | None = None) -> tuple[list[RequestTiming], float]:
    """Send `requests` at their arrival times; return per-request timings and the duration.
    time_limit (seconds): requests still running then are cancelled, their timing's status
    "CUT" (the tokens they received are counted in output_tokens)."""
    import grpc
    from tqdm import tqdm

    from pagedserve.wire.v1 import generation_pb2 as pb
    from pagedserve.wire.v1 import generation_pb2_grpc as pb_grpc

    prompts = prompt_token_ids(requests, seed=seed, vocab=vocab)
    timings = [RequestTiming(0.0) for _ in requests]
    bar = tqdm(total=len(requests), desc="requests", disable=not progress, leave=False)
    async with grpc.aio.insecure_channel(server) as channel:
        stub = pb_grpc.GenerationStub(channel)
        t0 = time.perf_counter()

        async def launch(i):
            await asyncio.sleep(max(0.0, requests[i].arrival - (time.perf_counter() - t0)))
            await _one(stub, pb, requests[i], prompts[i], timings[i], vocab)
            bar.update(1)

        tasks = [asyncio.ensure_future(launch(i)) for i in range(len(requests))]
        _, cut = await asyncio.wait(tasks, timeout=time_limit)
        for i, task in enumerate(tasks):
            if task in cut:
                task.cancel()
                timings[i].status, timings[i].end = "CUT", time.perf_counter()
        await asyncio.gather(*tasks, return_exceptions=True)
        duration = time.perf_counter() - t0
    bar.close()
    return timings, duration


def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve", help="load-test a running gateway over gRPC",
        description="Send a workload to a running pagedserve gateway at a request rate and "
                    "report throughput, TTFT, TPOT, inter-token and end-to-end latency, "
                    "normalized latency and goodput. --sweep finds the highest rate whose "
                    "normalized latency stays under a bound.",
    )
    p.add_argument("--server", default="127.0.0.1:50051", help="gateway address")
    p.add_argument("--workload", default="sharegpt", choices=WORKLOADS)
    p.add_argument("--trace", default=None, help="JSONL trace (arrival, prompt/prompt_len, output_len)")
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--rate", type=float, default=math.inf, help="requests/s (default: all at once)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-total", type=int, default=2048, help="cap on prompt + output tokens")
    p.add_argument("--vocab", type=int, default=32000, help="random prompt ids are drawn below this")
    p.add_argument("--slo-ttft", type=float, default=None, help="goodput: TTFT bound in seconds")
    p.add_argument("--slo-tpot", type=float, default=None, help="goodput: TPOT bound in seconds")
    p.add_argument("--sweep", default=None, metavar="RATES",
                   help="comma-separated rates to try in order, e.g. 0.5,1,2,4")
    p.add_argument("--latency-bound", type=float, default=None,
                   help="with --sweep: the normalized latency bound (s/token)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print results as JSON")
    p.add_argument("--out", default="bench_results/serve.json")
    p.set_defaults(run=run)


def _requests(args, rate):
    if args.trace:
        reqs = load_trace(args.trace)
    else:
        reqs = sample_lengths(args.workload, args.num_requests, seed=args.seed,
                              input_len=args.input_len, output_len=args.output_len,
                              max_total=args.max_total)
        poisson_arrivals(reqs, rate, seed=args.seed)
    return reqs


def measure(args, rate: float) -> dict:
    timings, duration = asyncio.run(run_load(args.server, _requests(args, rate), seed=args.seed,
                                             vocab=args.vocab, progress=not args.json))
    result = summarize(timings, duration, slo_ttft=args.slo_ttft, slo_tpot=args.slo_tpot)
    result["rate"] = rate
    return result


def _print(r: dict) -> None:
    print(f"rate {r['rate']:g} req/s: {r['completed']} done, errors {r['errors'] or 'none'}, "
          f"{r['request_throughput']:.2f} req/s, {r['output_token_throughput']:.1f} out tok/s")
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        s = r[key]
        print(f"  {key[:-2]:5} mean {s['mean'] * 1e3:9.1f} ms  median {s['median'] * 1e3:9.1f} ms"
              f"  p99 {s['p99'] * 1e3:9.1f} ms")
    print(f"  normalized latency {r['normalized_latency_s_per_token'] * 1e3:.1f} ms/token, "
          f"goodput {r['goodput_requests_per_s']:.2f} req/s")


def run(args) -> int:
    if args.sweep:
        if args.latency_bound is None:
            raise SystemExit("pagedserve bench serve: --sweep needs --latency-bound (s/token)")
        results, best = [], None
        for rate in (float(x) for x in args.sweep.split(",")):
            r = measure(args, rate)
            results.append(r)
            if not args.json:
                _print(r)
            if r["normalized_latency_s_per_token"] > args.latency_bound:
                break
            best = rate
        out = {"sweep": results, "best_rate": best, "latency_bound": args.latency_bound}
        if not args.json:
            print(f"highest rate under {args.latency_bound * 1e3:.0f} ms/token: {best}")
    else:
        out = measure(args, args.rate)
        if not args.json:
            _print(out)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    if args.json:
        print(json.dumps(out, indent=1))
    return 0
