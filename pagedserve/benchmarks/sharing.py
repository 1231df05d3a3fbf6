"""`pagedserve bench sharing`: what sharing saves and what preemption costs.

1. Memory saved by sharing, blocks saved / blocks needed without sharing, summed over every
   step of serving a workload: after each Reserve, the distinct blocks referenced against
   the sum of every device-resident sequence's block table. Parallel sampling (n = 2, 4, 6)
   runs with a model-free executor (every sample runs to the workload's output length, so
   the model does not matter); beam search (width 2, 4, 6) with the real model on text
   prompts (which beams survive is the model's doing), ignore_eos so lengths follow the
   workload. Prefix caching is off: only forks share.
2. Prefix caching: hit rate and time to first token of requests sharing a system prompt,
   against requests with distinct prefixes of the same length (real model, in process, one
   request at a time).
3. Swap against recompute per block size: seconds to copy a preempted sequence's blocks
   out and back in, against seconds to prefill its tokens again; what `auto` chooses under
   its measured costs, the shortest sequence it would swap, and its choices when serving a
   few requests in a pool too small for them.
"""
from __future__ import annotations

import inspect
import json
import os
import random
import statistics
import time

from pagedserve.executor.config import ExecutorConfig
from pagedserve.memsvc.config import MemoryConfig
from pagedserve.benchmarks.sim_memory import SimMemory
from pagedserve.wire.settings import add_flags

SHARING_WIDTHS = (2, 4, 6)


class _Measured:
    """A memory client that records block sharing after every reserve."""

    def __init__(self, memory, allocator):
        self.memory, self.allocator = memory, allocator
        self.shared = self.unshared = 0

    def reserve(self, plan):
        result = self.memory.reserve(plan)
        a = self.allocator
        tables = [a.block_table(s) for s in a.sequence_ids() if not a.is_swapped(s)]
        self.unshared += sum(len(t) for t in tables)
        self.shared += len({b for t in tables for b in t})
        return result

    def fork(self, parent_id, child_id):
        self.memory.fork(parent_id, child_id)

    def saved(self) -> float:
        return 1 - self.shared / self.unshared if self.unshared else 0.0


class _InstantExecutor:
    def __init__(self, block_size: int, max_model_len: int):
        from pagedserve.wire.protocol import KVGeometry, ModelInfo

        self.info = ModelInfo("simulated", max_model_len, 32000, [], None, "", KVGeometry(1, 1, 1, block_size))
        self.rng = random.Random(0)

    def model_info(self):
        return self.info

    def execute(self, batch):
        from pagedserve.wire.protocol import SampleOutput

        return [SampleOutput(batch.seq_ids[i], self.rng.randrange(32000)) for i in batch.sample.nonzero()[0].tolist()]


def text_corpus(tokenizer) -> list[int]:
    """Token ids of English prose and code that ship with Python (argparse's source)."""
    import argparse

    return tokenizer.encode(inspect.getsource(argparse), add_special_tokens=False)


def window(corpus: list[int], rng: random.Random, length: int) -> list[int]:
    start = rng.randrange(max(len(corpus) - length, 1))
    return corpus[start : start + length]


def parallel_sampling_saving(requests, n: int, block_size: int, max_model_len: int) -> float:
    from pagedserve.gateway.batch_loop import BatchLoop
    from pagedserve.gateway.scheduler_config import SchedulerConfig
    from pagedserve.memsvc import PagedAllocator
    from pagedserve.wire.protocol import SamplingParams

    need = sum(n * -(-(r.prompt_len + r.output_len) // block_size) for r in requests)
    alloc = PagedAllocator(need + 16, block_size, enable_prefix_caching=False)
    memory = _Measured(SimMemory(alloc), alloc)
    loop = BatchLoop(memory, _InstantExecutor(block_size, max_model_len),
                     SchedulerConfig(max_num_seqs=1024, max_num_batched_tokens=1 << 16, overlap=False))
    rng = random.Random(0)
    for i, r in enumerate(requests):
        loop.add_request(str(i), [rng.randrange(32000) for _ in range(r.prompt_len)],
                         SamplingParams(max_tokens=r.output_len, n=n, seed=i, ignore_eos=True))
    while loop.has_work():
        loop.step()
    return memory.saved()


def beam_saving(engine, requests, width: int, corpus: list[int]) -> float:
    from pagedserve.wire.protocol import SamplingParams

    memory = _Measured(engine.memory, engine.memory.allocator)
    engine.loop.memory.inner = memory  # pagedserve.gateway.in_process.InProcessMemory
    rng = random.Random(width)
    for r in requests:
        engine.add_request(window(corpus, rng, r.prompt_len),
                           SamplingParams(max_tokens=r.output_len, beam_width=width, ignore_eos=True))
    for _ in engine.stream():
        pass
    engine.loop.memory.inner = engine.memory
    return memory.saved()


def sharing(args) -> dict:
    from pagedserve.engine import LLMEngine
    from pagedserve.benchmarks.workloads import sample_lengths

    out = {}
    engine = None
    for workload, count, beam_count in (("alpaca", args.num_requests, args.beam_requests),
                                        ("sharegpt", args.num_requests, args.beam_requests)):
        requests = sample_lengths(workload, count, seed=args.seed, max_total=args.max_model_len)
        row = {f"n={n}": parallel_sampling_saving(requests, n, args.block_size, args.max_model_len)
               for n in SHARING_WIDTHS}
        beams = [r for r in requests if r.output_len <= args.beam_max_output][:beam_count]
        if beam_count:
            if engine is None:
                engine = LLMEngine(model=args.model, device=args.device, block_size=args.block_size, kv_tokens=args.kv_tokens,
                                   prefix_caching=False, max_model_len=args.max_model_len)
                corpus = text_corpus(engine.tokenizer)
            for w in SHARING_WIDTHS:
                row[f"beam={w}"] = beam_saving(engine, beams, w, corpus)
        row["beam_requests"] = [(r.prompt_len, r.output_len) for r in beams]
        out[workload] = row
        print(f"{workload:9}" + "".join(f" {k} {v:6.1%}" for k, v in row.items() if k != "beam_requests"),
              flush=True)
    return out


def first_token_seconds(engine, prompt: list[int]) -> tuple[float, int]:
    from pagedserve.wire.protocol import SamplingParams

    start = time.perf_counter()
    engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0))
    deltas = [d for d in engine.stream()]
    return time.perf_counter() - start, deltas[0].cached_tokens


def prefix_caching(args) -> dict:
    from pagedserve.engine import LLMEngine

    engine = LLMEngine(model=args.model, device=args.device, block_size=args.block_size, kv_tokens=args.kv_tokens)
    corpus = text_corpus(engine.tokenizer)
    rng = random.Random(args.seed)
    questions = [window(corpus, rng, rng.randint(16, 32)) for _ in range(args.prefix_requests)]
    first_token_seconds(engine, window(corpus, rng, 64))  # warm up
    system = window(corpus, rng, args.system_len)
    out = {}
    for case in ("distinct", "shared"):
        mem = engine.memory.allocator.prefix_stats
        queries, hits = mem.queries, mem.hits
        ttft, cached = [], []
        for q in questions:
            prefix = system if case == "shared" else window(corpus, rng, args.system_len)
            seconds, c = first_token_seconds(engine, prefix + q)
            ttft.append(seconds)
            cached.append(c)
        out[case] = {
            "hit_rate": (mem.hits - hits) / (mem.queries - queries),
            "ttft_mean_s": statistics.mean(ttft), "ttft_first_s": ttft[0],
            "ttft_rest_mean_s": statistics.mean(ttft[1:]), "cached_tokens": cached,
        }
        r = out[case]
        print(f"{case:9} system prompt: hit rate {r['hit_rate']:6.1%}  TTFT mean {r['ttft_mean_s']:.3f}s "
              f"(first {r['ttft_first_s']:.3f}s, others {r['ttft_rest_mean_s']:.3f}s)", flush=True)
    return out


def swap_vs_recompute(args) -> dict:
    from pagedserve.memsvc.host_pool import timed_copy
    from pagedserve.engine import LLMEngine
    from pagedserve.wire.protocol import SamplingParams

    out = {}
    for bs in args.swap_block_sizes:
        engine = LLMEngine(model=args.model, device=args.device, block_size=bs, kv_tokens=args.kv_tokens,
                           prefix_caching=False, swap_space=args.swap_space)
        corpus = text_corpus(engine.tokenizer)
        rng = random.Random(args.seed)
        prompt = window(corpus, rng, args.seq_len)
        recompute = []
        for _ in range(args.repeats):  # each call's step is reported to memsvc with the next one
            start = time.perf_counter()
            engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
            recompute.append(time.perf_counter() - start)
        mem = engine.memory
        alloc = mem.allocator
        alloc.add_sequence("victim", prompt, max_len=len(prompt))
        alloc.append("victim", prompt)
        blocks = alloc.block_table("victim")
        host = list(range(len(blocks)))
        swap = [timed_copy(mem.pool, mem.host_pool, blocks, host) + timed_copy(mem.host_pool, mem.pool, host, blocks)
                for _ in range(args.repeats)]
        alloc.free("victim")
        # serve a few requests in a pool too small for them; auto chooses per victim
        small = LLMEngine(model=args.model, device=args.device, block_size=bs, kv_tokens=max(4 * bs, args.small_kv_tokens),
                          prefix_caching=False, swap_space=args.swap_space)
        small.generate([window(corpus, rng, 48) for _ in range(6)],
                       SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
        counts = small.memory.stats().preemption
        policy = mem.policy
        out[bs] = {
            "seq_len": len(prompt), "blocks": len(blocks),
            "swap_s": statistics.median(swap), "recompute_s": statistics.median(recompute),
            "est_swap_s": policy.costs.swap_seconds(len(blocks)),
            "est_recompute_s": policy.costs.recompute_seconds(len(prompt)),
            "auto_chooses": policy.choose(len(blocks), len(prompt), True).mode,
            "crossover_tokens": policy.crossover_tokens(bs),
            "served": {k: counts[k] for k in ("num_swapped_out", "num_recomputed", "num_swap_fallbacks")},
        }
        r = out[bs]
        print(f"block {bs:3}: {r['blocks']:4} blocks, swap out+in {r['swap_s'] * 1e3:8.3f} ms, recompute "
              f"{r['recompute_s'] * 1e3:8.1f} ms; auto: {r['auto_chooses']}, swaps from "
              f"{r['crossover_tokens']} tokens; served: {r['served']}", flush=True)
    return out


def add_parser(sub) -> None:
    p = sub.add_parser(
        "sharing", help="memory saved by forks, prefix-cache TTFT, swap vs recompute",
        description="Measure what block sharing saves (parallel sampling n=2,4,6 and beam search "
                    "width 2,4,6 on Alpaca-like and ShareGPT-like lengths), the prefix cache's "
                    "hit rate and time to first token with a shared system prompt, and the cost "
                    "of preemption by swap and by recompute per block size.",
    )
    p.add_argument("--parts", default="sharing,prefix,swap", help="comma-separated: sharing,prefix,swap")
    add_flags(p, ExecutorConfig, only={"model", "block_size", "device", "max_model_len"},
              defaults={"max_model_len": 2048})
    add_flags(p, MemoryConfig, only={"kv_tokens", "swap_space"}, defaults={"kv_tokens": 65536, "swap_space": 1.0})
    p.add_argument("--num-requests", type=int, default=200, help="requests per workload (parallel sampling)")
    p.add_argument("--beam-requests", type=int, default=6, help="requests per workload (beam search, real model)")
    p.add_argument("--beam-max-output", type=int, default=400,
                   help="beam search uses the first requests whose output is at most this long")
    p.add_argument("--prefix-requests", type=int, default=8)
    p.add_argument("--system-len", type=int, default=300, help="tokens of the shared system prompt")
    p.add_argument("--swap-block-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 16, 32, 64])
    p.add_argument("--seq-len", type=int, default=256, help="tokens of the preempted sequence")
    p.add_argument("--small-kv-tokens", type=int, default=256, help="pool of the served-under-pressure run")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_results/sharing.json", help="JSON results file")
    p.set_defaults(run=run)


def run(args) -> int:
    import platform

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    parts = args.parts.split(",")
    results = {"machine": platform.processor() or platform.machine(), "torch": torch.__version__,
               "torch_threads": torch.get_num_threads()}
    for name, fn in (("sharing", sharing), ("prefix", prefix_caching), ("swap", swap_vs_recompute)):
        if name in parts:
            results[name] = fn(args)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {args.out}")
    return 0
