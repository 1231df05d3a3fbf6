"""What structured output costs: output tokens per second of the in-process engine with and
without a JSON-schema constraint, at batch 1 and 32 (greedy, 64 new tokens each, a schema
that stays open for all of them: an array of at least 20 {name, age} objects).

    .venv/bin/python -m pagedserve.benchmarks.structured_cost [--batches 1 32] [--max-tokens 64]

The masks come in through pagedserve.executor.logits_mask.GuidedSampler (computed right before
sampling, on the step's critical path): an upper bound on the cost of the model runner's
overlapped hook. Prints one JSON line per (batch, constrained).
"""
from __future__ import annotations

import argparse
import json
import time

SCHEMA = {"type": "array", "minItems": 20,
          "items": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                    "required": ["name", "age"], "additionalProperties": False}}


def run(engine, sampler, guided, batch, constrained, prompt, max_tokens) -> None:
    from pagedserve.wire.protocol import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                        guided_kind="json_schema" if constrained else "",
                        guided_spec=json.dumps(SCHEMA) if constrained else "")
    prompts = [f"{prompt} (list {i})" for i in range(batch)]
    if constrained:
        guided.grammar("json_schema", sp.guided_spec)  # compiled once and cached (not timed)
    sampler.mask_seconds, sampler.mask_steps = 0.0, 0
    start = time.perf_counter()
    outs = engine.generate(prompts, sp)
    secs = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for o in outs for c in o.completions)
    valid = sum(1 for o in outs if o.completions[0].text.lstrip().startswith("[")) if constrained else None
    print(json.dumps({"batch": batch, "json_schema": constrained, "output_tokens": tokens,
                      "seconds": round(secs, 3), "tok_per_s": round(tokens / secs, 1),
                      "started_as_schema": valid,
                      "mask_ms_per_step": round(1e3 * sampler.mask_seconds / sampler.mask_steps, 3)
                      if sampler.mask_steps else None}), flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeat", type=int, default=2, help="runs of each, interleaved (report the best)")
    args = p.parse_args(argv)
    from pagedserve.engine import LLMEngine
    from pagedserve.executor.logits_mask import GuidedDecoding, GuidedSampler
    from pagedserve.wire.protocol import SamplingParams

    engine = LLMEngine(kv_tokens=65536, max_num_seqs=max(args.batches), device=args.device)
    info = engine.info
    guided = GuidedDecoding(info.tokenizer_dir, info.vocab_size, info.eos_token_ids, tokenizer=engine.tokenizer)
    engine.executor.runner.guided = None  # masks through the wrapper, timed (not overlapped)
    sampler = engine.executor.runner.sampler = GuidedSampler(engine.executor.runner.sampler, guided)
    prompt = "List twenty people with their ages as JSON:"
    engine.generate([prompt], SamplingParams(max_tokens=4, temperature=0))  # warm up
    for batch in args.batches:
        for _ in range(args.repeat):
            for constrained in (False, True):
                run(engine, sampler, guided, batch, constrained, prompt, args.max_tokens)


if __name__ == "__main__":
    main()
