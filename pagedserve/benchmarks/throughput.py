"""`pagedserve bench throughput`: offline engine vs transformers' static batching, same workload."""
from __future__ import annotations

import gc
import json
import os
import random
import time

from pagedserve.benchmarks.busy_cores import add_busy_cores_arg, busy_cores
from pagedserve.benchmarks.roofline import (
    copy_bandwidth,
    linear_shapes,
    matmul_ceiling,
    model_weights,
    run_ceiling,
    step_rates,
)
from pagedserve.benchmarks.workloads import WORKLOADS, BenchRequest, random_prompt_ids, sample_lengths


def add_parser(sub) -> None:
    from pagedserve.engine_config import add_engine_flags

    p = sub.add_parser(
        "throughput",
        help="offline generation throughput, engine vs transformers",
        description="Run N requests through the in-process engine (continuous batching on the "
                    "paged cache) and through transformers' generate in static batches, on the "
                    "same lengths, and print tokens/s, the ratio, and the machine's ceiling.",
    )
    p.add_argument("--workload", default="random", choices=WORKLOADS)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128, help="random workload: prompt tokens")
    p.add_argument("--output-len", type=int, default=128, help="random workload: output tokens")
    p.add_argument("--min-len", type=int, default=16, help="uniform workload: shortest length")
    p.add_argument("--max-len", type=int, default=512, help="uniform workload: longest length")
    p.add_argument("--hf-batch-size", type=int, default=64, help="transformers' static batch size")
    p.add_argument("--skip-hf", action="store_true", help="run the engine only")
    p.add_argument("--linear-backends", metavar="LIST", default=None,
                   help="comma-separated --linear-backend values run one after another in this "
                        "process, side by side (e.g. auto,int4,auto,int4); the engine only; the "
                        "memory figures after the first run include what the allocator kept)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_results/throughput.json", help="JSON results file")
    add_busy_cores_arg(p)
    add_engine_flags(p)
    p.set_defaults(run=run)


def one_sequence(engine, vocab: int, seed: int, prompt_len: int = 128, steps: int = 32) -> dict:
    """Decode step time for a single sequence (median over its decode steps)."""
    from pagedserve.wire.protocol import SamplingParams

    rng = random.Random(seed + 1)
    engine.add_request(random_prompt_ids(rng, prompt_len, vocab),
                       SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True),
                       request_id="one-sequence")
    loop, times = engine.loop, []
    loop.step()  # the prefill
    while loop.has_work():
        t = time.perf_counter()
        loop.step()
        times.append(time.perf_counter() - t)
    times.sort()
    return {"decode_steps": len(times), "step_s_median": times[len(times) // 2],
            "step_s_min": times[0]}


def run_engine(engine, reqs: list[BenchRequest], vocab: int, seed: int) -> dict:
    from pagedserve.wire.protocol import SamplingParams

    rng = random.Random(seed)
    for i, r in enumerate(reqs):
        sp = SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True)
        engine.add_request(random_prompt_ids(rng, r.prompt_len, vocab), sp, request_id=str(i))
    loop, running, tokens = engine.loop, [], 0
    t0 = time.perf_counter()
    while loop.has_work():
        deltas = loop.step()
        tokens += sum(len(d.token_ids) for d in deltas)
        running.append(len(loop.scheduler.running))
    elapsed = time.perf_counter() - t0
    return {"output_tokens": tokens, "seconds": elapsed, "output_tokens_per_s": tokens / elapsed,
            "steps": len(running), "mean_running": sum(running) / max(len(running), 1),
            "max_running": max(running, default=0), "running_over_steps": running}


def run_hf(model_dir: str, reqs: list[BenchRequest], vocab: int, seed: int, batch_size: int,
           dtype: str) -> dict:
    """Static batches in arrival order, left-padded, each run until its longest member ends."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    rng = random.Random(seed)
    prompts = [random_prompt_ids(rng, r.prompt_len, vocab) for r in reqs]
    useful, t0 = 0, time.perf_counter()
    for start in range(0, len(reqs), batch_size):
        batch = prompts[start : start + batch_size]
        outs = [r.output_len for r in reqs[start : start + batch_size]]
        width = max(len(p) for p in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, p in enumerate(batch):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        n = max(outs)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)
        useful += sum(outs)
    elapsed = time.perf_counter() - t0
    return {"output_tokens": useful, "seconds": elapsed, "output_tokens_per_s": useful / elapsed}


def run(args) -> int:
    from pagedserve.benchmarks.cpu_info import cpu_info, describe

    cpu = cpu_info()
    print(f"cpu          {describe(cpu)}, {os.cpu_count()} CPUs")
    reqs = sample_lengths(args.workload, args.num_requests, seed=args.seed,
                          input_len=args.input_len, output_len=args.output_len,
                          min_len=args.min_len, max_len=args.max_len)
    if args.linear_backends:
        from pagedserve.executor.config import LINEAR_BACKENDS

        backends = args.linear_backends.split(",")
        unknown = [b for b in backends if b not in LINEAR_BACKENDS]
        if unknown:
            raise SystemExit(f"--linear-backends: {', '.join(unknown)} not among {', '.join(LINEAR_BACKENDS)}")
        result = {"cpu": cpu, "runs": []}
        for backend in backends:
            args.linear_backend = backend
            result["runs"].append(run_engine_part(args, reqs, cpu)[0])
            gc.unfreeze()  # the engine was frozen with the heap: let the next one have its memory
            gc.collect()
        print("side by side (in the order run):")
        for r in result["runs"]:
            print(f"  {r['linear_backend']:7} {r['engine']['output_tokens_per_s']:8.1f} output tok/s   one sequence "
                  f"{r['one_sequence']['step_s_median'] * 1e3:6.1f} ms per decode step "
                  f"({r['one_sequence']['weight_bytes'] / 1e6:.0f} MB of weights read)")
    else:
        result, engine = run_engine_part(args, reqs, cpu)
        if not args.skip_hf:
            engine_model_dir = engine.executor.model_dir
            del engine
            result["transformers"] = run_hf(engine_model_dir, reqs, result["vocab"], args.seed,
                                            args.hf_batch_size, args.dtype)
            h = result["transformers"]
            result["ratio"] = result["engine"]["output_tokens_per_s"] / h["output_tokens_per_s"]
            print(f"transformers {h['output_tokens_per_s']:8.1f} output tok/s  ({h['seconds']:.1f} s)")
            print(f"ratio        {result['ratio']:8.2f}x")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    return 0


def run_engine_part(args, reqs: list[BenchRequest], cpu: dict):
    """The engine on `args.linear_backend`: its plan, memory, offline run, ceiling and one
    sequence, printed; (the result, the engine)."""
    from pagedserve.benchmarks.proc_memory import resident
    from pagedserve.executor.linear import Linear
    from pagedserve.executor.linear_backend import summary
    from pagedserve.engine import LLMEngine
    from pagedserve.engine_config import EngineConfig
    from pagedserve.rpc.heap import freeze_heap

    engine = LLMEngine(EngineConfig.from_args(args))
    plan = engine.executor.linear_plan
    print(f"linear       --linear-backend {args.linear_backend}: {summary(plan)}")
    for choice in plan:
        print(f"             {choice.describe()}")
    mem = resident()
    dense = sum(m.held_bytes()[0] for m in engine.executor.model.modules() if isinstance(m, Linear))
    prepared = sum(m.held_bytes()[1] for m in engine.executor.model.modules() if isinstance(m, Linear))
    pool = engine.memory.pool
    pool_bytes = 0 if pool is None else pool.numel() * pool.element_size()
    if mem:
        print(f"memory       linear weights held {dense / 2**20:.0f} MiB dense + {prepared / 2**20:.0f} MiB "
              f"prepared; resident {mem['rss_bytes'] / 2**30:.2f} GiB after load, peak "
              f"{mem['peak_rss_bytes'] / 2**30:.2f} GiB (the KV pool's {pool_bytes / 2**30:.2f} GiB "
              "included, as it is touched)")
    freeze_heap()  # as the services do once started
    info = engine.info
    vocab = info.vocab_size
    cfg = engine.executor.config
    params, weight_bytes = model_weights(engine.executor.model)
    result = {
        "workload": args.workload, "vocab": vocab, "num_requests": len(reqs), "model": info.name,
        "mean_prompt_len": sum(r.prompt_len for r in reqs) / len(reqs),
        "mean_output_len": sum(r.output_len for r in reqs) / len(reqs),
        "machine": f"{os.cpu_count()} CPUs", "cpu": cpu,
        "linear_backend": args.linear_backend, "linear_plan": [c.as_dict() for c in plan],
        "linear_plan_source": summary(plan),
        "memory": {**mem, "linear_dense_bytes": dense, "linear_prepared_bytes": prepared,
                   "kv_pool_bytes": pool_bytes},
        "ceiling": matmul_ceiling(cfg.hidden_size, cfg.intermediate_size, 2.0 * params),
        "step_rates": step_rates(engine, reqs),
    }
    print(f"workload {args.workload}: {len(reqs)} requests, mean {result['mean_prompt_len']:.0f} in"
          f" / {result['mean_output_len']:.0f} out")
    with busy_cores(args.busy_cores):
        result["engine"] = run_engine(engine, reqs, vocab, args.seed)
        one = one_sequence(engine, vocab, args.seed)
    e = result["engine"]
    share = engine.executor.core_share
    result["busy_cores"] = args.busy_cores
    result["threads"] = {"at_end": share.threads if share else None, "changes": share.changes if share else 0}
    if args.busy_cores or (share and share.changes):
        print(f"threads      {args.busy_cores} other core(s) held busy; compute threads at the end "
              f"{result['threads']['at_end']}, changed {result['threads']['changes']} time(s)")
    after = matmul_ceiling(cfg.hidden_size, cfg.intermediate_size, 2.0 * params)
    if after["matmul_flops_per_s"] > result["ceiling"]["matmul_flops_per_s"]:  # measured before and after: the higher
        result["ceiling"] = after
    for phase, rate in step_rates(engine, reqs).items():
        if rate["matmul_flops_per_s"] > result["step_rates"][phase]["matmul_flops_per_s"]:
            result["step_rates"][phase] = rate
    print(f"pagedserve   {e['output_tokens_per_s']:8.1f} output tok/s  ({e['output_tokens']} tokens, "
          f"{e['seconds']:.1f} s, mean batch {e['mean_running']:.1f}, max {e['max_running']})")
    c = result["ceiling"]
    print(f"ceiling      {c['ceiling_tokens_per_s']:8.1f} tok/s  (matmul {c['matmul_flops_per_s']/1e9:.1f}"
          f" GFLOP/s / {c['flops_per_token']/1e9:.2f} GFLOP per token); engine at "
          f"{e['output_tokens_per_s'] / c['ceiling_tokens_per_s']:.0%} of it")
    # the ceiling counts output tokens only; the run also computed every prompt token once
    prompt_tokens = sum(r.prompt_len for r in reqs)
    e["computed_tokens_per_s"] = (prompt_tokens + e["output_tokens"]) / e["seconds"]
    e["computed_share_of_ceiling"] = e["computed_tokens_per_s"] / c["ceiling_tokens_per_s"]
    print(f"             counting the {prompt_tokens} prompt tokens computed too: "
          f"{e['computed_tokens_per_s']:.1f} tok/s, {e['computed_share_of_ceiling']:.0%} of the ceiling")
    bandwidth = copy_bandwidth()
    one.update(weight_bytes=weight_bytes, copy_bytes_per_s=bandwidth, floor_s=weight_bytes / bandwidth)
    one["over_floor"] = one["step_s_median"] / one["floor_s"]
    result["one_sequence"] = one
    print(f"one sequence {one['step_s_median'] * 1e3:8.1f} ms per decode step (median of "
          f"{one['decode_steps']}); weight-read floor {one['floor_s'] * 1e3:.1f} ms "
          f"({weight_bytes / 1e6:.0f} MB of weights / {bandwidth / 1e9:.1f} GB/s copy bandwidth): "
          f"{one['over_floor']:.2f}x the floor")
    head = getattr(engine.executor.model, "lm_head", None)
    head_flops = 2.0 * head.shape[0] * head.shape[1] if head is not None else 0.0
    rates = result["step_rates"]
    c.update(run_ceiling(reqs, e["output_tokens"], c["flops_per_token"], head_flops,
                         rates["decode"]["matmul_flops_per_s"], info.kv.bytes_per_token, bandwidth,
                         prompt_flops_per_s=rates["prefill"]["matmul_flops_per_s"]))
    e["share_of_run_ceiling"] = (c["run_matmul_s"] + c["run_kv_s"]) / e["seconds"]
    print(f"run ceiling  {c['run_ceiling_output_tokens_per_s']:8.1f} tok/s  ({prompt_tokens + e['output_tokens']} "
          f"computed tokens' matmuls {c['run_matmul_s']:.1f} s (prompt rows without the LM head, at "
          f"{rates['prefill']['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s in {rates['prefill']['rows']}-row chunks; "
          f"output rows at {rates['decode']['matmul_flops_per_s'] / 1e9:.1f} in {rates['decode']['rows']}-row "
          f"batches) + decode K/V reads {c['run_kv_s']:.1f} s at {c['mean_decode_context']:.0f} tokens of "
          f"context); engine at {e['share_of_run_ceiling']:.0%} of it")
    flat = run_ceiling(reqs, e["output_tokens"], c["flops_per_token"], head_flops, c["matmul_flops_per_s"],
                       info.kv.bytes_per_token, bandwidth)
    c["at_512_rows"] = flat
    e["share_of_run_ceiling_at_512_rows"] = (flat["run_matmul_s"] + flat["run_kv_s"]) / e["seconds"]
    print(f"             every row at the 512-row rate instead ({c['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s): "
          f"{flat['run_ceiling_output_tokens_per_s']:.1f} tok/s; engine at "
          f"{e['share_of_run_ceiling_at_512_rows']:.0%} of it")
    result["load_avg"] = os.getloadavg()
    return result, engine
