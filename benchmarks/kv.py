"""`pagedserve bench kv`: where the KV pool goes, per allocation policy, with no model.

The real allocator and the real scheduler run the workload; the executor is replaced by
one that returns a token at once, so generated lengths come from the workload. Each step
the pool is partitioned into token state, reserved, internal and external fragmentation
and free, and averaged over the steps in which requests were waiting for memory.

`--window W` adds a run of the paged policy for a model whose every layer has a sliding
window of W positions (Mistral-style; KVGeometry.window): memsvc frees each sequence's
blocks that left the window, reported as "paged+window".
"""
from __future__ import annotations

import json
import os
import random

from executor.config import ExecutorConfig
from gateway.batch_loop import BatchLoop
from gateway.config import GatewayConfig
from memsvc.config import MemsvcConfig
from gateway.scheduler import SchedulerConfig
from memsvc import POLICIES, make_allocator
from memsvc.step_planner import StepPlanner
from wire.protocol import KVGeometry, ModelInfo, SampleOutput, SamplingParams
from benchmarks.workloads import WORKLOADS, load_trace, sample_lengths
from wire.settings import add_flags

_FIELDS = ("token_state", "reserved", "internal_fragmentation", "external_fragmentation", "free")
_VOCAB = 32000


class _SimMemory:
    """memsvc's decisions without a pool: nothing to copy."""

    def __init__(self, allocator):
        self.allocator = allocator
        self.planner = StepPlanner(allocator)

    def reserve(self, plan):
        return self.planner.reserve(plan).result


class _InstantExecutor:
    def __init__(self, max_model_len: int, block_size: int, window: int = 0):
        self.info = ModelInfo("simulated", max_model_len, _VOCAB, [], None, "",
                              KVGeometry(1, 1, 1, block_size, window=window))

    def model_info(self):
        return self.info

    def execute(self, batch):
        return [SampleOutput(s.seq_id, 1) for s in batch.seqs if s.sample]


def simulate(policy: str, requests, *, kv_tokens: int, block_size: int, max_model_len: int,
             max_num_seqs: int, max_num_batched_tokens: int, seed: int = 0, window: int = 0) -> dict:
    allocator = make_allocator(policy, kv_tokens // block_size, block_size,
                               max_model_len=max_model_len, enable_prefix_caching=False,
                               window=window or None)
    loop = BatchLoop(_SimMemory(allocator), _InstantExecutor(max_model_len, block_size, window),
                     SchedulerConfig(max_num_seqs, max_num_batched_tokens))
    rng = random.Random(seed)
    for i, r in enumerate(requests):
        prompt = [rng.randrange(_VOCAB) for _ in range(min(r.prompt_len, max_model_len - 1))]
        out_len = min(r.output_len, max_model_len - len(prompt))
        loop.add_request(str(i), prompt, SamplingParams(max_tokens=out_len, ignore_eos=True),
                         final_len=len(prompt) + out_len)
    sums = dict.fromkeys(_FIELDS, 0.0)
    running, saturated_steps, steps, rejected = [], 0, 0, 0
    sched = loop.scheduler
    while loop.has_work():
        rejected += sum(1 for d in loop.step() if d.finish_reason == "error")
        steps += 1
        running.append(len(sched.running))
        if not sched.waiting:
            continue
        head = sched.waiting[0]
        need = None
        if hasattr(allocator, "reservation_blocks"):
            need = allocator.reservation_blocks(head.max_len, head.final_len)
        snap = allocator.snapshot(next_request_blocks=need)
        saturated_steps += 1
        for f in _FIELDS:
            sums[f] += getattr(snap, f)
    total = allocator.num_blocks * block_size
    n = max(saturated_steps, 1)
    breakdown = {f: sums[f] / n / total for f in _FIELDS}
    used = 1.0 - breakdown["free"]
    return {
        "token_state_fraction": breakdown["token_state"] / used if used > 0 else 0.0,
        "mean_running": sum(running) / max(len(running), 1),
        "max_running": max(running, default=0),
        "breakdown": breakdown,
        "steps": steps, "saturated_steps": saturated_steps, "rejected": rejected,
        "blocks_released": getattr(allocator, "blocks_released", 0),
    }


def add_parser(sub) -> None:
    p = sub.add_parser(
        "kv", help="pool utilization and batch-size ceiling per allocation policy (no model)",
        description="Simulate the memory side of serving a workload with the real memsvc "
                    "allocator and the real scheduler, for each allocation policy, and report "
                    "the pool breakdown (time-averaged over the steps where requests waited "
                    "for memory) and how many requests ran together.",
    )
    p.add_argument("--workload", default="sharegpt", choices=WORKLOADS)
    p.add_argument("--trace", default=None, help="a JSONL trace instead of --workload")
    p.add_argument("--num-requests", type=int, default=300)
    add_flags(p, MemsvcConfig, only={"kv_tokens"}, defaults={"kv_tokens": 15700})
    add_flags(p, ExecutorConfig, only={"block_size", "max_model_len"}, defaults={"max_model_len": 2048})
    add_flags(p, GatewayConfig, only={"max_num_seqs", "max_num_batched_tokens"},
              defaults={"max_num_seqs": 256, "max_num_batched_tokens": 4096})
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated policies")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--window", type=int, default=0,
                   help="also run paged with a sliding window of this many positions on every "
                        "layer, freeing blocks that left it (default: 0, none)")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    p.add_argument("--out", default="bench_results/kv.json", help="JSON results file")
    p.set_defaults(run=run)


def run(args) -> int:
    if args.trace:
        requests = load_trace(args.trace)
    else:
        requests = sample_lengths(args.workload, args.num_requests, seed=args.seed,
                                  max_total=args.max_model_len)
    results = {}
    for policy in args.policies.split(","):
        results[policy] = simulate(policy, requests, kv_tokens=args.kv_tokens,
                                   block_size=args.block_size, max_model_len=args.max_model_len,
                                   max_num_seqs=args.max_num_seqs,
                                   max_num_batched_tokens=args.max_num_batched_tokens,
                                   seed=args.seed)
    if args.window:
        results["paged+window"] = simulate(
            "paged", requests, kv_tokens=args.kv_tokens, block_size=args.block_size,
            max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, seed=args.seed, window=args.window)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    if args.json:
        print(json.dumps(results, indent=1))
        return 0
    print(f"{'policy':18} {'token state':>11} {'reserved':>9} {'internal':>9} {'external':>9}"
          f" {'free':>6} {'mean batch':>10} {'max batch':>9}")
    for policy, r in results.items():
        b = r["breakdown"]
        print(f"{policy:18} {r['token_state_fraction']:11.1%} {b['reserved']:9.1%} "
              f"{b['internal_fragmentation']:9.1%} {b['external_fragmentation']:9.1%} "
              f"{b['free']:6.1%} {r['mean_running']:10.1f} {r['max_running']:9d}")
    if "paged" in results:
        for policy, r in results.items():
            if policy not in ("paged", "paged+window") and r["mean_running"]:
                print(f"paged runs {results['paged']['mean_running'] / r['mean_running']:.1f}x the "
                      f"mean batch of {policy}")
    if "paged+window" in results and results["paged"]["mean_running"]:
        w = results["paged+window"]
        print(f"a sliding window of {args.window} positions frees {w['blocks_released']} blocks and runs "
              f"{w['mean_running'] / results['paged']['mean_running']:.2f}x the mean batch of paged")
    print(f"wrote {args.out}")
    return 0
