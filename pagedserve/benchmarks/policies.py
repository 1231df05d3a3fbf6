"""`pagedserve bench policies`: paged vs contiguous reservation on the real engine, side by side.

One invocation runs the same arrivals through the in-process engine once per allocation
policy and rate, in real time, with a KV budget small enough that memory binds, then
through transformers' static batching under the same memory as an outside baseline, and
finds for each the highest rate whose normalized latency stays under the bound.
"""
from __future__ import annotations

import json
import os
import random
import time

from pagedserve.benchmarks.serve_metrics import RequestTiming, summarize
from pagedserve.benchmarks.workloads import WORKLOADS, poisson_arrivals, sample_lengths
from pagedserve.executor.config import ExecutorConfig
from pagedserve.wire.settings import add_flags

POLICIES = ("paged", "contiguous-max", "contiguous-oracle")


def run_engine(engine, reqs, prompts) -> dict:
    """Feed requests at their arrival times; step while there is work."""
    from pagedserve.wire.protocol import SamplingParams

    loop, timings = engine.loop, [RequestTiming(0.0) for _ in reqs]
    running, breakdown, pending = [], [], list(range(len(reqs)))
    t0 = time.perf_counter()
    while pending or loop.has_work():
        now = time.perf_counter() - t0
        while pending and reqs[pending[0]].arrival <= now:
            i = pending.pop(0)
            r = reqs[i]
            timings[i].start = t0 + r.arrival
            engine.add_request(prompts[i], SamplingParams(max_tokens=r.output_len, temperature=0.0,
                                                          ignore_eos=True),
                               request_id=str(i), final_len=len(prompts[i]) + r.output_len)
        if not loop.has_work():
            time.sleep(max(0.0, reqs[pending[0]].arrival - now))
            continue
        deltas = loop.step()
        t = time.perf_counter()
        for d in deltas:
            tm = timings[int(d.request_id)]
            tm.token_times += [t] * len(d.token_ids)
            tm.output_tokens += len(d.token_ids)
            if d.finish_reason:
                tm.end = t
        running.append((t - t0, len(loop.scheduler.running)))
        snap = engine.memory.allocator.snapshot()
        breakdown.append({k: getattr(snap, k) / snap.total_slots for k in (
            "token_state", "reserved", "internal_fragmentation", "external_fragmentation", "free")})
    out = summarize(timings, time.perf_counter() - t0)
    out["running_over_time"] = running
    out["breakdown"] = {k: sum(b[k] for b in breakdown) / max(len(breakdown), 1)
                        for k in (breakdown[0] if breakdown else {})}
    out["mean_running"] = sum(n for _, n in running) / max(len(running), 1)
    return out


def run_hf(model, reqs, prompts, max_batch: int) -> dict:
    """Static batching: when a batch ends, take up to max_batch arrived requests, pad, run
    until the longest ends."""
    import torch

    timings, pending = [RequestTiming(0.0) for _ in reqs], list(range(len(reqs)))
    t0 = time.perf_counter()
    while pending:
        now = time.perf_counter() - t0
        ready = [i for i in pending if reqs[i].arrival <= now][:max_batch]
        if not ready:
            time.sleep(reqs[pending[0]].arrival - now)
            continue
        for i in ready:
            pending.remove(i)
            timings[i].start = t0 + reqs[i].arrival
        width = max(len(prompts[i]) for i in ready)
        ids = torch.zeros(len(ready), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(ready):
            ids[row, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[row, width - len(prompts[i]):] = 1
        n = max(reqs[i].output_len for i in ready)
        first = []

        class _Clock:  # transformers' streamer hook: the time each new token arrives
            def put(self, _):
                first.append(time.perf_counter())

            def end(self):
                pass

        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0, streamer=_Clock())
        step_times = first[1:]  # the first put() is the prompt itself
        for i in ready:
            k = reqs[i].output_len
            timings[i].token_times = step_times[:k]
            timings[i].output_tokens = k
            timings[i].end = step_times[k - 1]
    return summarize(timings, time.perf_counter() - t0)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "policies", help="paged vs contiguous reservation vs transformers on the real engine",
        description="Run the same Poisson arrivals through the in-process engine with each "
                    "allocation policy (and through transformers' static batching under the same "
                    "memory), at several rates, with a KV budget that holds --reservations "
                    "maximum-length requests; report throughput and normalized latency and draw "
                    "the plots.",
    )
    p.add_argument("--workload", default="alpaca", choices=WORKLOADS)
    p.add_argument("--num-requests", type=int, default=60)
    p.add_argument("--rates", default="1,2,4,8", help="comma-separated request rates (req/s)")
    add_flags(p, ExecutorConfig, only={"max_model_len", "device"}, defaults={"max_model_len": 256})
    p.add_argument("--reservations", type=int, default=8,
                   help="KV budget = this many maximum-length requests (default: 8)")
    p.add_argument("--latency-bound", type=float, default=0.2, help="normalized latency bound, s/token")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="bench_results/policies")
    p.set_defaults(run=run)


def run(args) -> int:
    from pagedserve.engine import LLMEngine

    rates = [float(r) for r in args.rates.split(",")]
    base = sample_lengths(args.workload, args.num_requests, seed=args.seed,
                          max_total=args.max_model_len)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(100, 32000) for _ in range(r.prompt_len)] for r in base]
    kv_tokens = args.reservations * args.max_model_len
    results: dict[str, dict] = {}
    model_dir = None
    for policy in args.policies.split(","):
        engine = LLMEngine(policy=policy, kv_tokens=kv_tokens, max_model_len=args.max_model_len,
                           prefix_caching=False, max_num_seqs=256, device=args.device)
        model_dir = engine.executor.model_dir
        results[policy] = {}
        for rate in rates:
            poisson_arrivals(base, rate, seed=args.seed)
            r = run_engine(engine, base, prompts)
            results[policy][str(rate)] = r
            _line(policy, rate, r)
        del engine
    if not args.skip_hf:
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        results["transformers"] = {}
        for rate in rates:
            poisson_arrivals(base, rate, seed=args.seed)
            r = run_hf(model, base, prompts, args.reservations)
            results["transformers"][str(rate)] = r
            _line("transformers", rate, r)
    summary = {name: _best_rate(by_rate, args.latency_bound) for name, by_rate in results.items()}
    print(f"highest rate with normalized latency <= {args.latency_bound * 1e3:.0f} ms/token:")
    for name, s in summary.items():
        print(f"  {name:18} {s['rate']!s:>6} req/s  {s['throughput']:7.1f} out tok/s")
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "policies.json"), "w") as f:
        json.dump({"args": vars(args) | {"run": None}, "results": results, "summary": summary}, f)
    from pagedserve.benchmarks.plots import plot_policies

    for path in plot_policies(results, rates, args.latency_bound, args.out_dir):
        print(f"wrote {path}")
    return 0


def _line(name, rate, r) -> None:
    print(f"{name:18} rate {rate:5g}: {r['output_token_throughput']:7.1f} out tok/s, normalized "
          f"{r['normalized_latency_s_per_token'] * 1e3:7.1f} ms/token, TTFT p50 "
          f"{r['ttft_s']['median']:.2f} s, mean batch {r.get('mean_running', 0):.1f}")


def _best_rate(by_rate: dict, bound: float) -> dict:
    best = {"rate": None, "throughput": 0.0}
    for rate, r in by_rate.items():
        if r["normalized_latency_s_per_token"] <= bound and r["output_token_throughput"] > best["throughput"]:
            best = {"rate": float(rate), "throughput": r["output_token_throughput"]}
    return best
