"""`pagedserve bench kv-dtype-accuracy`: how far an opt-in 16-bit KV cache (`--kv-cache-dtype
bfloat16` or float16) moves the default model from a float32 one, float32 weights on the CPU.

The measures of pagedserve.benchmarks.int8_accuracy.compare (teacher-forced: max |logit
difference|, the same over the logit spread, argmax agreement; free-running: identical greedy
continuations, tokens before they first differ), the candidate engine differing from the
reference in --kv-cache-dtype only. Prints them and writes them, with the CPU, to --out.
"""
from __future__ import annotations

import json
import os


def add_parser(sub) -> None:
    p = sub.add_parser("kv-dtype-accuracy", help="a 16-bit KV cache's logits and greedy tokens "
                       "against a float32 one's", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model directory or .gguf (off: the default model)")
    p.add_argument("--candidate", action="append", choices=("bfloat16", "float16"),
                   help="a --kv-cache-dtype to compare with float32 (repeatable; default: bfloat16)")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--out", default="bench_results/kv_dtype_accuracy.json", help="JSON results file")
    p.set_defaults(run=run)


def run(args) -> None:
    from pagedserve.benchmarks.int8_accuracy import PROMPTS, compare
    from pagedserve.benchmarks.cpu_info import cpu_info
    from pagedserve.engine import LLMEngine

    def make(kv):
        return LLMEngine(model=args.model, kv_cache_dtype=kv, kv_tokens=4096, device="cpu",
                         dtype="float32", linear_backend="mkl")

    reference = make("float32")
    results = {kv: compare(reference, make(kv), PROMPTS, args.new_tokens)
               for kv in args.candidate or ("bfloat16",)}
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"cpu": cpu_info(), "results": results}, f, indent=1)
    print(json.dumps(results, indent=1))
