"""`pagedserve bench profile`: where one decode step of the in-process engine spends its time.

For each batch size, B random prompts are prefilled, then decode steps run under
torch.profiler. Time is split by what the model does: matrix multiplies (the linear layers
and the LM head), attention (the paged-attention kernel, K/V gathers included), K/V stores,
other tensor work in the forward (embedding, norms, rotary, activation, residuals), the
sampler, the step's metadata (StepBatch -> tensors), and the rest of the step in Python
(the forward's own interpreter time between ops, and the batching loop outside execute).
"""
from __future__ import annotations

import json
import os
import random
import time

CATEGORIES = ("matmul", "attention", "store_kv", "other_ops", "sampler", "metadata",
              "python_forward", "loop_outside_execute")


def add_parser(sub) -> None:
    from pagedserve.engine_config import add_engine_flags

    p = sub.add_parser(
        "profile",
        help="torch.profiler breakdown of a decode step by kind of work",
        description="Prefill B random prompts, then profile decode steps of the in-process "
                    "engine and print where the time goes, per batch size.",
    )
    p.add_argument("--batch-sizes", default="1,64", help="comma-separated decode batch sizes")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per sequence")
    p.add_argument("--steps", type=int, default=8, help="profiled decode steps per batch size")
    p.add_argument("--warmup", type=int, default=3, help="decode steps before profiling")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_results/profile.json", help="JSON results file")
    add_engine_flags(p)
    p.set_defaults(run=run)


def _classify(name: str) -> str:
    n = name.lower()
    if any(k in n for k in ("linear", "addmm", "matmul", "aten::mm", "bmm", "mkldnn_", "_mkl_")):
        return "matmul"
    return "other_ops"


def _patch_scopes(engine):
    """Wrap the kernels (the C++ linear ones too), the sampler, the metadata build and the LM head in named profiler
    scopes (the model calls them through their modules, so patching the attribute works)."""
    import torch
    from pagedserve import kernels
    from pagedserve.executor import attention_metadata, model_runner
    from pagedserve.kernels import linear_cpu, panel_cpu

    runner = engine.executor.runner
    model = engine.executor.model
    saved = []

    def wrap(obj, attr, label):
        fn = getattr(obj, attr)

        def scoped(*a, **k):
            with torch.profiler.record_function(label):
                return fn(*a, **k)

        saved.append((obj, attr, fn))
        setattr(obj, attr, scoped)

    wrap(kernels, "paged_attention", "#attention")
    wrap(kernels, "store_kv", "#store_kv")
    for name in dir(kernels):  # CPU-specific entry points the model may call directly
        if name.startswith("paged_decode") and callable(getattr(kernels, name)):
            wrap(kernels, name, "#attention")
    for module in (linear_cpu, panel_cpu):  # the C++ linear kernels (ctypes: no torch op to see)
        wrap(module, "matmul", "#matmul")
        wrap(module, "matmul_silu", "#matmul")
    wrap(runner.sampler, "sample", "#sampler")
    wrap(model, "compute_logits", "#lm_head")
    meta_cls = attention_metadata.AttentionMetadata
    orig_from_batch = meta_cls.from_batch.__func__

    def from_batch(cls, *a, **k):
        with torch.profiler.record_function("#metadata"):
            return orig_from_batch(cls, *a, **k)

    meta_cls.from_batch = classmethod(from_batch)
    saved.append((meta_cls, "from_batch", classmethod(orig_from_batch)))
    orig_forward = model.forward

    def forward(*a, **k):
        with torch.profiler.record_function("#forward"):
            return orig_forward(*a, **k)

    model.forward = forward
    saved.append((model, "forward", orig_forward))
    del model_runner
    return saved


def _unpatch(saved):
    for obj, attr, fn in reversed(saved):
        if attr == "forward" and not isinstance(obj, type):
            del obj.forward
        else:
            setattr(obj, attr, fn)


def breakdown(events, step_wall_s: float, execute_wall_s: float, steps: int) -> dict:
    """Per-step milliseconds by category from the profiler's event tree."""
    ms = dict.fromkeys(CATEGORIES, 0.0)

    def under(evt, label):
        while evt is not None:
            if evt.name == label:
                return True
            evt = evt.cpu_parent
        return False

    for evt in events:
        if evt.name in ("#attention", "#store_kv", "#sampler", "#metadata") and not under(evt.cpu_parent, evt.name):
            key = evt.name[1:]
            ms[key] += evt.cpu_time_total / 1e3
        elif evt.name == "#lm_head" or (evt.name == "#matmul" and not under(evt.cpu_parent, "#lm_head")):
            ms["matmul"] += evt.cpu_time_total / 1e3
        elif evt.name == "#forward":
            children = sum(c.cpu_time_total for c in evt.cpu_children) / 1e3
            ms["python_forward"] += evt.cpu_time_total / 1e3 - children
            for c in evt.cpu_children:
                if c.name.startswith("#"):
                    continue
                ms[_classify(c.name)] += c.cpu_time_total / 1e3
    ms = {k: v / steps for k, v in ms.items()}
    profiled = sum(ms.values())
    ms["loop_outside_execute"] = max(0.0, (step_wall_s - execute_wall_s) * 1e3 / steps)
    # what the profiler saw inside execute but outside the named scopes (runner glue)
    ms["python_forward"] += max(0.0, execute_wall_s * 1e3 / steps - profiled)
    return ms


def profile_batch(engine, batch: int, input_len: int, steps: int, warmup: int, seed: int) -> dict:
    import torch
    from pagedserve.benchmarks.workloads import random_prompt_ids
    from pagedserve.wire.protocol import SamplingParams

    rng = random.Random(seed)
    loop = engine.loop
    # Both timed phases decode every sequence at every step. Prompts chunked over several
    # steps get their first tokens on different steps, and the first ones decode on while the
    # last prefill: a budget that counts only the timed steps ran out before the end.
    ids = [f"p{batch}-{i}" for i in range(batch)]
    per_step = engine.loop.scheduler.config.max_num_batched_tokens - batch  # prompt tokens a prefill step takes at least
    most_prefill = -(-batch * input_len // max(per_step, 1)) + 1
    budget = min(warmup + 2 * steps + 2 + most_prefill, max(1, engine.info.max_model_len - input_len))
    for rid in ids:
        engine.add_request(random_prompt_ids(rng, input_len, engine.info.vocab_size),
                           SamplingParams(max_tokens=budget, temperature=0.0, ignore_eos=True),
                           request_id=rid)
    # prefill: until every sequence has its first token
    prefill_steps = 0
    while len(loop.scheduler.running) < batch or \
            any(not s.output_token_ids for s in loop.scheduler.running):
        loop.step()
        prefill_steps += 1
    if prefill_steps + warmup + 2 * steps + 2 > budget:  # (only where the model's length caps it)
        raise ValueError(f"each sequence may decode {budget} tokens (--input-len {input_len} of the model's "
                         f"{engine.info.max_model_len}): too few for {prefill_steps} prefill, {warmup} warm-up and "
                         f"2 x {steps} timed steps; give a shorter --input-len or fewer --steps")
    execute = engine.executor.execute
    spent = [0.0]

    def timed(b):
        t = time.perf_counter()
        try:
            return execute(b)
        finally:
            spent[0] += time.perf_counter() - t

    for _ in range(warmup):
        loop.step()
    # unprofiled timing
    engine.executor.execute = timed
    t0 = time.perf_counter()
    plain_tokens = sum(len(d.token_ids) for _ in range(steps) for d in loop.step())
    plain_step = (time.perf_counter() - t0) / steps
    plain_execute = spent[0] / steps
    saved = _patch_scopes(engine)
    spent[0] = 0.0
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            profiled_tokens = sum(len(d.token_ids) for _ in range(steps) for d in loop.step())
            wall = time.perf_counter() - t0
    finally:
        _unpatch(saved)
        engine.executor.execute = execute
    if plain_tokens != batch * steps or profiled_tokens != batch * steps:
        raise RuntimeError(f"a timed phase decoded {plain_tokens} and {profiled_tokens} tokens, "
                           f"not {batch} x {steps}: its steps were not all full decode steps")
    ms = breakdown(prof.events(), wall, spent[0], steps)
    for rid in ids:
        loop.abort(rid)
    while loop.has_work():
        loop.step()
    top = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
    return {"batch": batch, "context": input_len, "step_ms": plain_step * 1e3,
            "execute_ms": plain_execute * 1e3, "profiled_step_ms": wall * 1e3 / steps,
            "breakdown_ms": ms, "top_ops": top}


def run(args) -> int:
    import torch
    from pagedserve.engine import LLMEngine
    from pagedserve.engine_config import EngineConfig

    engine = LLMEngine(EngineConfig.from_args(args))
    sizes = [int(x) for x in args.batch_sizes.split(",") if x]
    result = {"model": engine.info.name, "torch": torch.__version__,
              "torch_threads": torch.get_num_threads(), "load_avg": os.getloadavg(), "runs": []}
    print(f"{engine.info.name}, {args.dtype}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, load {os.getloadavg()[0]:.2f}")
    for b in sizes:
        r = profile_batch(engine, b, args.input_len, args.steps, args.warmup, args.seed)
        result["runs"].append(r)
        ms = r["breakdown_ms"]
        total = sum(ms.values())
        print(f"\nbatch {b}, context ~{args.input_len}: step {r['step_ms']:.1f} ms unprofiled "
              f"(execute {r['execute_ms']:.1f} ms), {r['profiled_step_ms']:.1f} ms under the profiler")
        for k in CATEGORIES:
            print(f"  {k:22s} {ms[k]:8.2f} ms  {ms[k] / total:6.1%}")
        if os.environ.get("PROFILE_TOP"):
            print(r["top_ops"])
    result["load_avg_end"] = os.getloadavg()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    return 0

