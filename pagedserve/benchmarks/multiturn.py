"""`pagedserve bench multiturn`: multi-turn chats on a pool too small for their histories,
with the prefix cache's host tier (--kv-offload) off and on, in one run (issue 27).

N conversations share a system prompt; each has T turns whose prompt is the whole history
so far (system, then every user message and answer) plus a new user message. Turns arrive
interleaved, round robin over the conversations (every conversation's first turn, then
every second turn, ...), from a closed-loop client with `--concurrency` requests in flight:
by the time a conversation speaks again, the others' histories have gone through the pool.
The engine is the in-process one (pagedserve.engine), greedy, the same prompts both runs.
Per run: prompt tokens computed (prompt - cached, per request), every token the executor
computed (recomputes after preemption included), prefix-cache hit rates (pool and host, of
all prompt tokens), TTFT p50/p90 (arrival to first token), output tokens/s over the run,
the host tier's counters and bytes copied, the seconds spent in memsvc's Reserve and in
its block copies (where the tier's cost shows, free of the host's noise), and
`outputs_sha256` (every output's tokens): equal in both runs when the outputs are.
`--no-reuse`: every prompt fresh (same lengths, no shared history), where the tier offloads
and never pays back. `--repeat N`: off and on N times each, interleaved; each reports its
fastest run (the others' seconds in `runs_seconds`). See BENCHMARKS.md.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import time


def add_parser(sub) -> None:
    from pagedserve.engine_config import add_engine_flags
    from pagedserve.memsvc.config import MemoryConfig
    from pagedserve.wire.settings import add_flags

    p = sub.add_parser(
        "multiturn", help="multi-turn chats on a small pool, host tier (--kv-offload) off and on",
        description="Run N interleaved multi-turn conversations through the in-process engine "
                    "twice, with the prefix cache's host tier off and then on, and print prompt "
                    "tokens computed, prefix-cache hit rates (pool, host), TTFT p50/p90, output "
                    "throughput and bytes copied for each; outputs must match.",
    )
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-len", type=int, default=128, help="shared system prompt tokens")
    p.add_argument("--user-len", type=int, default=64, help="tokens of each user message")
    p.add_argument("--output-len", type=int, default=32, help="tokens of each answer")
    p.add_argument("--concurrency", type=int, default=2, help="requests in flight at most")
    p.add_argument("--no-reuse", action="store_true",
                   help="every prompt fresh (same lengths): the tier's cost when it never pays")
    p.add_argument("--repeat", type=int, default=1,
                   help="off and on this many times each, interleaved; the fastest of each is reported")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help='print {"off": {...}, "on": {...}}')
    p.add_argument("--out", default="bench_results/multiturn.json", help="JSON results file")
    add_engine_flags(p)
    add_flags(p, MemoryConfig, only={"kv_offload"}, defaults={"kv_offload": 0.5})
    p.set_defaults(run=run, kv_tokens=1024)


def _messages(args, vocab: int) -> tuple[list[int], dict]:
    rng = random.Random(args.seed)
    system = [rng.randrange(vocab) for _ in range(args.system_len)]
    users = {(c, t): [rng.randrange(vocab) for _ in range(args.user_len)]
             for c in range(args.conversations) for t in range(args.turns)}
    return system, users


def run_chats(engine, args) -> dict:
    from pagedserve.wire.protocol import SamplingParams

    vocab = engine.info.vocab_size
    system, users = _messages(args, vocab)
    fresh = random.Random(args.seed + 1)
    greedy = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    history = {c: list(system) for c in range(args.conversations)}
    computed = {"tokens": 0}
    execute = engine.executor.execute

    def counting(batch):
        computed["tokens"] += len(batch.token_ids)
        return execute(batch)

    engine.executor.execute = counting
    timed = {"reserve_s": 0.0, "copy_s": 0.0}
    memory = engine.memory
    reserve, copy = memory.reserve, memory._copy

    def timing(name, fn):
        def call(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                timed[name] += time.perf_counter() - t
        return call

    memory.reserve, memory._copy = timing("reserve_s", reserve), timing("copy_s", copy)
    arrived, first, outputs, prompt_computed, prompt_total, out_tokens = {}, {}, {}, 0, 0, 0

    def submit(c: int, t: int) -> None:
        prompt = history[c] + users[(c, t)]
        if args.no_reuse:
            prompt = [fresh.randrange(vocab) for _ in prompt]
        history[c] = prompt
        rid = f"{c}-{t}"
        engine.add_request(prompt, greedy, request_id=rid)
        arrived[rid], outputs[rid] = time.perf_counter(), []

    order = [(c, t) for t in range(args.turns) for c in range(args.conversations)]
    done: set[tuple[int, int]] = set()

    def feed() -> None:
        while order and len(arrived) - len(done) < args.concurrency:
            c, t = order[0]
            if t and (c, t - 1) not in done:
                return
            submit(*order.pop(0))

    start = time.perf_counter()
    feed()
    loop = engine.loop
    while loop.has_work():
        for d in loop.step():
            if d.error:
                raise RuntimeError(f"request {d.request_id} failed: {d.error}")
            if d.token_ids and d.request_id not in first:
                first[d.request_id] = time.perf_counter()
            outputs[d.request_id].extend(d.token_ids)
            out_tokens += len(d.token_ids)
            if d.finish_reason is not None:
                c, t = map(int, d.request_id.split("-"))
                prompt_total += d.prompt_tokens
                prompt_computed += d.prompt_tokens - d.cached_tokens
                history[c] = history[c] + outputs[d.request_id]
                done.add((c, t))
        feed()
    seconds = time.perf_counter() - start
    engine.executor.execute = execute
    memory.reserve, memory._copy = reserve, copy
    ttft = sorted(first[r] - arrived[r] for r in arrived)
    digest = hashlib.sha256(repr(sorted(outputs.items())).encode()).hexdigest()
    return {"requests": len(arrived), "prompt_tokens": prompt_total,
            "prompt_tokens_computed": prompt_computed, "tokens_computed": computed["tokens"],
            "output_tokens": out_tokens, "seconds": seconds, "output_tok_s": out_tokens / seconds,
            "ttft_p50_s": ttft[len(ttft) // 2], "ttft_p90_s": ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))],
            "reserve_s": timed["reserve_s"], "copy_s": timed["copy_s"], "outputs_sha256": digest}


def one_run(args, kv_offload: float) -> dict:
    from pagedserve.engine import LLMEngine
    from pagedserve.engine_config import EngineConfig

    config = EngineConfig.from_args(args)
    config = dataclasses.replace(config, memory=dataclasses.replace(config.memory, kv_offload=kv_offload))
    engine = LLMEngine(config)
    result = run_chats(engine, args)
    stats = engine.memory.stats()
    engine.memory.check_integrity()
    p, queries = stats.preemption, max(stats.prefix_cache_queries, 1)
    host_tokens = p["host_tier_tokens_restored"]
    block_bytes = engine.info.kv.bytes_per_block
    result.update(
        pool_blocks=stats.snapshot["num_blocks"], block_bytes=block_bytes,
        pool_hit_rate=(stats.prefix_cache_hits - host_tokens) / queries,
        host_hit_rate=host_tokens / queries,
        host_tier={k.removeprefix("host_tier_"): v for k, v in p.items() if k.startswith("host_tier_")},
        bytes_offloaded=p["host_tier_offloaded"] * block_bytes,
        bytes_restored=p["host_tier_restored"] * block_bytes,
        swapped_out=p["num_swapped_out"], recomputed=p["num_recomputed"],
        leaked_blocks=stats.snapshot["blocks_referenced"])
    return result


def run(args) -> int:
    from pagedserve.benchmarks.cpu_info import cpu_info, describe

    cpu = cpu_info()
    print(f"cpu      {describe(cpu)}, {os.cpu_count()} CPUs")
    hist = args.system_len + args.turns * (args.user_len + args.output_len)
    print(f"workload {args.conversations} conversations x {args.turns} turns, {args.concurrency} in flight, "
          f"system {args.system_len}, "
          f"user {args.user_len}, answer {args.output_len} tokens{' (no reuse)' if args.no_reuse else ''}; "
          f"histories {args.conversations * hist} tokens on a pool of {args.kv_tokens} "
          f"({args.conversations * hist / args.kv_tokens:.1f}x)")
    if args.repeat < 1:
        raise SystemExit(f"--repeat must be >= 1, got {args.repeat}")
    runs = {"off": [], "on": []}
    for _ in range(args.repeat):
        runs["off"].append(one_run(args, 0.0))
        runs["on"].append(one_run(args, args.kv_offload))
    results = {}
    for name, rs in runs.items():
        if len({r["outputs_sha256"] for r in rs}) > 1:
            raise RuntimeError(f"the {name} runs gave different outputs")
        results[name] = min(rs, key=lambda r: r["seconds"])
        results[name]["runs_seconds"] = [r["seconds"] for r in rs]
    results["on"]["kv_offload_gib"] = args.kv_offload
    off, on = results["off"], results["on"]
    ratios = {"prompt_tokens_computed": on["prompt_tokens_computed"] / max(off["prompt_tokens_computed"], 1),
              "ttft_p50": on["ttft_p50_s"] / off["ttft_p50_s"],
              "output_tok_s": on["output_tok_s"] / off["output_tok_s"],
              "outputs_equal": on["outputs_sha256"] == off["outputs_sha256"]}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({**results, "ratios": ratios, "cpu": cpu, "args": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool, type(None)))}}, f, indent=1)
    if args.json:
        print(json.dumps(results, indent=1))
        return 0 if ratios["outputs_equal"] else 1
    print(f"{'tier':5} {'prompt computed':>15} {'all computed':>12} {'pool hit':>8} {'host hit':>8} "
          f"{'TTFT p50':>9} {'p90':>7} {'out tok/s':>9} {'copied MiB':>10} {'reserve s':>9} {'copy s':>7}")
    for name, r in results.items():
        copied = (r["bytes_offloaded"] + r["bytes_restored"]) / 2**20
        print(f"{name:5} {r['prompt_tokens_computed']:15d} {r['tokens_computed']:12d} {r['pool_hit_rate']:8.1%} "
              f"{r['host_hit_rate']:8.1%} {r['ttft_p50_s']:8.3f}s {r['ttft_p90_s']:6.3f}s "
              f"{r['output_tok_s']:9.1f} {copied:10.1f} {r['reserve_s']:9.2f} {r['copy_s']:7.2f}")
    print(f"on/off   prompt tokens computed {ratios['prompt_tokens_computed']:.2f}x, TTFT p50 "
          f"{ratios['ttft_p50']:.2f}x, output tok/s {ratios['output_tok_s']:.2f}x; outputs "
          f"{'identical' if ratios['outputs_equal'] else 'DIFFER'} (sha256 {on['outputs_sha256'][:12]})")
    print(f"wrote {args.out}")
    return 0 if ratios["outputs_equal"] else 1
