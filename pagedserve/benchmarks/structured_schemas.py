"""`pagedserve bench structured-schemas`: structured outputs on real-world JSON schemas, as a
user gets them: each schema of a JSONSchemaBench sample (shared/jsonschemabench/) goes through
the gateway's check (pagedserve.gateway.structured.from_openai, as an OpenAI response_format json_schema)
and, when accepted, to the in-process engine as a chat request (greedy, --max-tokens).

Each output is counted once: refused (400 at the gateway), valid (finished and valid against
the original schema), truncated (finish_reason length) or invalid (finished, but not JSON or
not valid). Also printed: the grammar compile time per schema and the mask time per token
(pagedserve.executor.logits_mask.GuidedSampler, computed on the step's critical path). JSON to --out,
with every output's tail for reading. `--without bounds` sends schemas unbounded
(pagedserve.gateway.schema_bounds) and `--without closing` turns off the steering to close near
max_tokens (pagedserve.executor.logits_mask), to see what each part does.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from collections import Counter

SAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "shared", "jsonschemabench", "sample.jsonl")
PROMPT = "Give an example of a JSON object that follows this JSON schema:\n{schema}"


def add_parser(sub) -> None:
    p = sub.add_parser("structured-schemas", help="JSONSchemaBench sample through response_format: "
                       "valid / truncated / invalid / refused", description=__doc__.split("\n\n")[0])
    p.add_argument("--sample", default=SAMPLE, help="JSONL of {kind, source, schema}")
    p.add_argument("--limit", type=int, default=0, help="first N schemas only (0: all)")
    p.add_argument("--max-tokens", type=int, default=300)
    p.add_argument("--batch", type=int, default=16, help="requests in flight at once")
    p.add_argument("--device", default="cpu")
    p.add_argument("--without", choices=("bounds", "closing"), action="append", default=[],
                   help="turn a part of the fix off (repeatable)")
    p.add_argument("--out", default="bench_results/structured_schemas.json", help="JSON results file")
    p.set_defaults(run=run)


def load(path: str, limit: int = 0) -> list[dict]:
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return rows[:limit] if limit else rows


def verdict(text: str, finish_reason: str | None, schema: dict) -> tuple[str, str]:
    """(outcome, detail) of one finished output."""
    import jsonschema

    if finish_reason == "length":
        return "truncated", ""
    try:
        value = json.loads(text)
    except ValueError as e:
        return "invalid", f"not JSON: {e}"
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as e:
        return "invalid", e.message[:200]
    return "valid", ""


def measure(rows: list[dict], max_tokens: int, batch: int, device: str, without=()) -> dict:
    from pagedserve.engine import LLMEngine
    from pagedserve.executor import logits_mask
    from pagedserve.executor.logits_mask import GuidedDecoding, GuidedSampler
    from pagedserve.gateway import schema_bounds, structured
    from pagedserve.wire.protocol import SamplingParams

    if "bounds" in without:
        schema_bounds.bound = lambda schema: schema
    if "closing" in without:
        logits_mask.close_window = lambda max_tokens, depth=0: -1

    engine = LLMEngine(kv_tokens=65536, max_num_seqs=batch, device=device)
    info = engine.info
    guided = GuidedDecoding(info.tokenizer_dir, info.vocab_size, info.eos_token_ids, tokenizer=engine.tokenizer)
    engine.executor.runner.guided = None  # masks through the wrapper, timed (not overlapped)
    sampler = engine.executor.runner.sampler = GuidedSampler(engine.executor.runner.sampler, guided)
    guided.compiler()  # the tokenizer's info, once (not a grammar's cost)
    results, jobs = [], []
    for row in rows:
        r = {"kind": row["kind"], "source": row["source"]}
        body = {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": row["schema"]}}}
        try:
            kind, spec = structured.from_openai(body)
        except structured.GuidedError as e:
            r.update(outcome="refused", detail=str(e))
            results.append(r)
            continue
        t = time.perf_counter()
        guided.grammar(kind, spec)
        r["compile_ms"] = round(1e3 * (time.perf_counter() - t), 2)
        prompt = PROMPT.format(schema=json.dumps(row["schema"]))
        jobs.append((r, row["schema"], prompt, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                              guided_kind=kind, guided_spec=spec)))
        results.append(r)
    tokens = 0
    start = time.perf_counter()
    for i in range(0, len(jobs), batch):
        chunk = jobs[i:i + batch]
        outs = engine.generate([p for _, _, p, _ in chunk], [sp for _, _, _, sp in chunk], chat=True)
        for (r, schema, _, _), out in zip(chunk, outs):
            c = out.completions[0]
            tokens += len(c.token_ids)
            outcome, detail = verdict(c.text, c.finish_reason, schema)
            r.update(outcome=outcome, detail=detail, finish_reason=c.finish_reason,
                     output_tokens=len(c.token_ids), tail=c.text[-160:])
    seconds = time.perf_counter() - start
    compile_ms = [r["compile_ms"] for r in results if "compile_ms" in r]
    counts = Counter(r["outcome"] for r in results)
    return {"schemas": len(results), "max_tokens": max_tokens, "without": list(without),
            **{k: counts.get(k, 0) for k in ("valid", "truncated", "invalid", "refused")},
            "by_kind": {k: dict(Counter(r["outcome"] for r in results if r["kind"] == k))
                        for k in sorted({r["kind"] for r in results})},
            "compile_ms_median": round(statistics.median(compile_ms), 2) if compile_ms else None,
            "compile_ms_max": max(compile_ms, default=None),
            "mask_ms_per_token": round(1e3 * sampler.mask_seconds / tokens, 4) if tokens else None,
            "output_tokens": tokens, "seconds": round(seconds, 1), "results": results}


def run(args) -> int:
    from pagedserve.benchmarks.cpu_info import cpu_info, describe

    rows = load(args.sample, args.limit)
    m = measure(rows, args.max_tokens, args.batch, args.device, args.without)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"cpu": cpu_info(), **m}, f, indent=1)
    off = f", without {' and '.join(m['without'])}" if m["without"] else ""
    print(f"{m['schemas']} schemas, max_tokens {m['max_tokens']}, greedy{off} ({describe(cpu_info())})")
    print(f"valid {m['valid']}  truncated {m['truncated']}  invalid {m['invalid']}  refused {m['refused']}")
    for kind, c in m["by_kind"].items():
        print(f"  {kind:12s} " + "  ".join(f"{k} {v}" for k, v in sorted(c.items())))
    print(f"grammar compile: median {m['compile_ms_median']} ms, max {m['compile_ms_max']} ms; "
          f"mask {m['mask_ms_per_token']} ms per output token ({m['output_tokens']} tokens, {m['seconds']} s)")
    for r in m["results"]:
        if r["outcome"] in ("invalid", "refused"):
            print(f"  {r['outcome']}: {r['source']}: {r['detail']}")
    return 0
