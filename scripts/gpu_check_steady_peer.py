"""The steady part's peer: transformers' continuous batching (transformers >= 5:
`model.init_continuous_batching()`'s ContinuousBatchingManager, paged attention with its own
defaults: CUDA graphs, its KV cache sized from free memory) on the model object pagedserve
served from disk, given the same prompt ids and output lengths, greedy, EOS off (as
`bench serve`'s ignore_eos). All requests are queued at once (rate inf).

`transformers_cb(model, prompts, lengths, time_limit)` returns output tok/s, TTFT and TPOT
(from the tokens' timestamps transformers records), and where time_limit cuts the run: the
finished requests, the tokens they made, and (read from the manager's scheduler, when it
exposes it) the tokens of those still running, counted in the throughput.
"""
from __future__ import annotations

import statistics
import time


def quantiles(values: list[float]) -> dict:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    s = sorted(values)
    return {"mean": statistics.fmean(s), "median": statistics.median(s),
            "p99": s[min(len(s) - 1, int(round(0.99 * (len(s) - 1))))]}


def in_flight_tokens(manager) -> int | None:
    """Tokens made so far by requests not yet finished (None: this version does not say)."""
    try:
        active = manager.batch_processor.scheduler.active_requests
        return sum(state.generated_len() for state in list(active.values()))
    except Exception:  # noqa: BLE001 - internals of transformers: a figure, not a requirement
        return None


def transformers_cb(model, prompts: list[list[int]], lengths: list[int], time_limit: float) -> dict:
    import torch
    import transformers
    from transformers import ContinuousBatchingConfig, GenerationConfig

    config = GenerationConfig(max_new_tokens=max(lengths), do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = {}
    if not torch.cuda.is_available():  # the rehearsal: a cache for these requests, not 90% of the host's memory
        need = sum(-(-(len(p) + n) // 256) for p, n in zip(prompts, lengths))
        cb["continuous_batching_config"] = ContinuousBatchingConfig(num_blocks=need + 4, max_batch_tokens=2048)
    t0 = time.perf_counter()
    try:  # the hints generate_batch gives, which size the batch and the cache
        from transformers.generation.continuous_batching.utils import WorkloadHints

        hints = WorkloadHints(max_prompt_length=max(map(len, prompts)), max_generated_length=max(lengths),
                              num_requests=len(prompts))
        manager = model.init_continuous_batching(generation_config=config, workload_hints=hints, **cb)
    except ImportError:
        manager = model.init_continuous_batching(generation_config=config, **cb)
    if torch.cuda.is_available():
        manager.warmup()  # CUDA graphs captured before the clock starts, as generate_batch does
    manager.start()
    setup_s = time.perf_counter() - t0
    outputs, errors, cut_in_flight = {}, {}, None
    try:
        start = time.perf_counter()
        for i, (ids, n) in enumerate(zip(prompts, lengths)):
            manager.add_request(ids, request_id=f"r{i}", max_new_tokens=n, record_timestamps=True, eos_token_id=-1)
        deadline = start + time_limit
        while len(outputs) + len(errors) < len(prompts) and time.perf_counter() < deadline:
            out = manager.get_result(timeout=min(0.5, max(0.01, deadline - time.perf_counter())))
            if out is None:
                if not manager.is_running():
                    break
                continue
            if out.error:
                errors[out.request_id] = out.error
            elif out.is_finished():
                outputs[out.request_id] = (time.perf_counter(), out)
        duration = time.perf_counter() - start
        if len(outputs) + len(errors) < len(prompts):
            cut_in_flight = in_flight_tokens(manager)
    finally:
        manager.stop(block=True, timeout=30)
    made = sum(len(o.generated_tokens) for _, o in outputs.values())
    ttft, tpot = [], []
    for _, o in outputs.values():
        stamps = o.timestamps or []
        if stamps:
            ttft.append(stamps[0] - start)
        if len(stamps) > 1:
            tpot.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
    short = sum(1 for i, n in enumerate(lengths) if f"r{i}" in outputs and len(outputs[f"r{i}"][1].generated_tokens) != n)
    counted = made + (cut_in_flight or 0)
    return {"transformers": transformers.__version__, "requests": len(prompts), "completed": len(outputs),
            "errors": len(errors), "first_error": next(iter(errors.values()), None),
            "wrong_lengths": short, "output_tokens": made, "in_flight_tokens_at_cut": cut_in_flight,
            "cut": len(outputs) + len(errors) < len(prompts), "duration_s": duration, "setup_s": setup_s,
            "output_token_throughput": counted / duration if duration else 0.0,
            "ttft_s": quantiles(ttft), "tpot_s": quantiles(tpot),
            "config": repr(getattr(manager, "continuous_batching_config", None))[:600]}
