"""`pagedserve bench kv`: where the KV pool goes, per allocation policy, with no model.

The real allocator and the real scheduler run the workload; the executor is replaced by
one that returns a token at once, so generated lengths come from the workload. Each step
the pool is partitioned into token state, reserved, internal and external fragmentation
and free, and averaged over the steps in which requests were waiting for memory.

`--window W` adds a run of the paged policy for a model whose every layer has a sliding
window of W positions (Mistral-style; KVGeometry.window): memsvc frees each sequence's
blocks that left the window, reported as "paged+window".

`--conversations C --kv-offload-blocks N` adds two runs of the paged policy with prefix
caching on a chat arrangement of the same requests: request i is turn i // C of
conversation i % C, its prompt the conversation's history (earlier prompts and answers)
plus its own tokens, and it arrives when the conversation's previous turn has finished (a
history that would pass max_model_len starts over). "paged+prefix" has no host tier,
"paged+offload" one of N blocks (pagedserve.memsvc.host_tier; issue 27): the breakdown adds the
tokens computed (recomputes included), the tier's occupancy (time-averaged like the
pool's), its hit rate, blocks offloaded and restored, and the prompt tokens it saved from
being computed.
"""
from __future__ import annotations

import json
import os
import random

from pagedserve.executor.config import ExecutorConfig
from pagedserve.gateway.batch_loop import BatchLoop
from pagedserve.memsvc.config import MemoryConfig
from pagedserve.gateway.scheduler_config import SchedulerConfig
from pagedserve.memsvc import POLICIES, make_allocator
from pagedserve.benchmarks.sim_memory import SimMemory
from pagedserve.wire.protocol import KVGeometry, ModelInfo, SampleOutput, SamplingParams
from pagedserve.benchmarks.workloads import WORKLOADS, load_trace, sample_lengths
from pagedserve.wire.settings import add_flags

_FIELDS = ("token_state", "reserved", "internal_fragmentation", "external_fragmentation", "free")
_VOCAB = 32000


class _InstantExecutor:
    def __init__(self, max_model_len: int, block_size: int, window: int = 0):
        self.info = ModelInfo("simulated", max_model_len, _VOCAB, [], None, "",
                              KVGeometry(1, 1, 1, block_size, window=window))
        self.tokens_computed = 0  # every token a step computed, recomputes included

    def model_info(self):
        return self.info

    def execute(self, batch):
        self.tokens_computed += len(batch.token_ids)
        return [SampleOutput(batch.seq_ids[i], 1) for i in batch.sample.nonzero()[0].tolist()]


class _Chats:
    """The chat arrangement: request i is turn i // C of conversation i % C; a turn is
    added when its conversation's previous turn has finished."""

    def __init__(self, loop, requests, conversations: int, max_model_len: int, rng: random.Random):
        self.loop, self.max_model_len, self.rng = loop, max_model_len, rng
        self.turns = {c: [(i, r) for i, r in enumerate(requests) if i % conversations == c]
                      for c in range(conversations)}
        self.history = {c: [] for c in self.turns}
        self.outputs: dict[str, list[int]] = {}
        for c in self.turns:
            self._next(c)

    def _next(self, c: int) -> None:
        if not self.turns[c]:
            return
        i, r = self.turns[c].pop(0)
        own = [self.rng.randrange(_VOCAB) for _ in range(min(r.prompt_len, self.max_model_len - 1))]
        prompt = self.history[c] + own
        if len(prompt) + r.output_len > self.max_model_len:
            prompt = own  # a new conversation
        out_len = min(r.output_len, self.max_model_len - len(prompt))
        self.history[c] = prompt
        self.outputs[str(i)] = []
        self.loop.add_request(str(i), prompt, SamplingParams(max_tokens=out_len, ignore_eos=True),
                              final_len=len(prompt) + out_len)

    def delta(self, d) -> None:
        self.outputs[d.request_id].extend(d.token_ids)
        if d.finish_reason is not None:
            c = int(d.request_id) % len(self.turns)
            self.history[c] = self.history[c] + self.outputs.pop(d.request_id)
            self._next(c)


def simulate(policy: str, requests, *, kv_tokens: int, block_size: int, max_model_len: int,
             max_num_seqs: int, max_num_batched_tokens: int, seed: int = 0, window: int = 0,
             conversations: int = 0, offload_blocks: int = 0) -> dict:
    allocator = make_allocator(policy, kv_tokens // block_size, block_size,
                               max_model_len=max_model_len, enable_prefix_caching=conversations > 0,
                               window=window or None, num_offload_blocks=offload_blocks)
    executor = _InstantExecutor(max_model_len, block_size, window)
    loop = BatchLoop(SimMemory(allocator), executor,
                     SchedulerConfig(max_num_seqs, max_num_batched_tokens, overlap=False))
    rng = random.Random(seed)
    chats = _Chats(loop, requests, conversations, max_model_len, rng) if conversations else None
    for i, r in enumerate(requests if chats is None else []):
        prompt = [rng.randrange(_VOCAB) for _ in range(min(r.prompt_len, max_model_len - 1))]
        out_len = min(r.output_len, max_model_len - len(prompt))
        loop.add_request(str(i), prompt, SamplingParams(max_tokens=out_len, ignore_eos=True),
                         final_len=len(prompt) + out_len)
    sums = dict.fromkeys(_FIELDS, 0.0)
    running, saturated_steps, steps, rejected = [], 0, 0, 0
    prompt_tokens = 0
    tier = allocator.offload.tier if getattr(allocator, "offload", None) else None
    tier_used = 0.0
    sched = loop.scheduler
    while loop.has_work():
        for d in loop.step():
            rejected += int(d.finish_reason == "error")
            if d.finish_reason is not None:
                prompt_tokens += d.prompt_tokens
            if chats is not None:
                chats.delta(d)
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
        if tier is not None:
            tier_used += tier.num_used / tier.num_blocks
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
        "prompt_tokens": prompt_tokens,
        "tokens_computed": executor.tokens_computed,
        "host_tier": _tier_stats(allocator, tier_used / n),
    }


def _tier_stats(allocator, occupancy: float) -> dict | None:
    """The host tier's counters (None without one); occupancy time-averaged like the pool."""
    offload = getattr(allocator, "offload", None)
    if offload is None:
        return None
    s = offload.tier.stats
    return {"blocks": offload.tier.num_blocks, "occupancy": occupancy, "lookups": s.lookups,
            "hits": s.hits, "hit_rate": s.hit_rate, "offloaded": s.offloaded, "restored": s.restored,
            "dropped": s.dropped, "evicted": s.evicted, "tokens_not_recomputed": offload.tokens_restored}


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
    add_flags(p, MemoryConfig, only={"kv_tokens"}, defaults={"kv_tokens": 15700})
    add_flags(p, ExecutorConfig, only={"block_size", "max_model_len"}, defaults={"max_model_len": 2048})
    add_flags(p, SchedulerConfig, only={"max_num_seqs", "max_num_batched_tokens"},
              defaults={"max_num_seqs": 256, "max_num_batched_tokens": 4096})
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated policies")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--window", type=int, default=0,
                   help="also run paged with a sliding window of this many positions on every "
                        "layer, freeing blocks that left it (default: 0, none)")
    p.add_argument("--conversations", type=int, default=0,
                   help="also run paged with prefix caching on the requests arranged as this many "
                        "chats (each turn's prompt is its history), without and with a host tier "
                        "(default: 0, none)")
    p.add_argument("--kv-offload-blocks", type=int, default=64,
                   help="the host tier's size in blocks for --conversations (bench kv has no model "
                        "to turn --kv-offload GiB into blocks; default: 64)")
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
    if args.conversations:
        if args.conversations < 1 or args.kv_offload_blocks < 1:
            raise SystemExit("--conversations and --kv-offload-blocks must be positive")
        for name, blocks in (("paged+prefix", 0), ("paged+offload", args.kv_offload_blocks)):
            results[name] = simulate(
                "paged", requests, kv_tokens=args.kv_tokens, block_size=args.block_size,
                max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, seed=args.seed,
                conversations=args.conversations, offload_blocks=blocks)
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
            if policy in POLICIES and policy != "paged" and r["mean_running"]:
                print(f"paged runs {results['paged']['mean_running'] / r['mean_running']:.1f}x the "
                      f"mean batch of {policy}")
    if "paged+window" in results and results["paged"]["mean_running"]:
        w = results["paged+window"]
        print(f"a sliding window of {args.window} positions frees {w['blocks_released']} blocks and runs "
              f"{w['mean_running'] / results['paged']['mean_running']:.2f}x the mean batch of paged")
    if "paged+offload" in results:
        _print_chats(results, args.conversations)
    print(f"wrote {args.out}")
    return 0


def _print_chats(results: dict, conversations: int) -> None:
    base, on = results["paged+prefix"], results["paged+offload"]
    t = on["host_tier"]
    print(f"{conversations} chats: tokens computed {base['tokens_computed']} without the host tier, "
          f"{on['tokens_computed']} with it ({on['tokens_computed'] / max(base['tokens_computed'], 1):.2f}x; "
          f"recomputes after preemption included)")
    print(f"host tier ({t['blocks']} blocks): occupancy {t['occupancy']:.1%}, hit rate {t['hit_rate']:.1%} "
          f"({t['hits']}/{t['lookups']} blocks), offloaded {t['offloaded']}, restored {t['restored']}, "
          f"dropped {t['dropped']}, evicted {t['evicted']}, tokens not recomputed "
          f"{t['tokens_not_recomputed']}")
