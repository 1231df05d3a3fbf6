"""How far `--linear-backend int8` / `int4` move a model from float32:
`python -m pagedserve.benchmarks.int8_accuracy [--candidate int8 --candidate int4]` (default: both).

compare(reference, candidate, prompts, new_tokens) takes two in-process engines on the same
model (float32 weights, int8 or int4 weights) and returns, over the prompts:
- teacher-forced: both models score the same text (each prompt followed by the reference's
  greedy continuation) in one prefill: the largest |logit difference| at any position, the
  same relative to the reference's logit spread there (max - min), and the share of
  positions whose argmax agrees;
- free-running: each engine's own greedy continuation of `new_tokens`: the share of prompts
  whose continuations are identical and the mean number of tokens before they first differ.
"""
from __future__ import annotations

import argparse
import json

PROMPTS = [
    "<|im_start|>user\nWhat is a paged KV cache?<|im_end|>\n<|im_start|>assistant\n",
    "The quick brown fox jumps over the lazy dog. Then the dog",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "The capital of France is",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village by the river,",
]


def prefill_logits(model, config, ids: list[int], block_size: int = 16, kv_dtype=None):
    """float32 logits [len(ids), vocab] of `ids` scored in one step, on a pool of its own (in
    kv_dtype, a torch dtype; None: the model's)."""
    import torch

    from pagedserve.executor.model_runner import ModelRunner
    from pagedserve.step.whole_seqs import Seq, batch_of

    blocks = -(-len(ids) // block_size)
    pool = torch.zeros(blocks, config.num_layers, 2, block_size, config.num_kv_heads,
                       config.head_dim, dtype=kv_dtype or model.dtype)
    runner = ModelRunner(model, config, pool, kv_dtype=kv_dtype)
    batch = batch_of([Seq("s", list(ids), 0, list(range(blocks)))], block_size)
    with torch.inference_mode():
        return runner.logits(batch)


def greedy(engine, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    from pagedserve.wire.protocol import SamplingParams

    sampling = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    return [o.completions[0].token_ids for o in engine.generate(prompts, sampling)]


def compare(reference, candidate, prompts: list[str], new_tokens: int = 32) -> dict:
    """Each engine scores in its own KV cache dtype (--kv-cache-dtype) as well."""
    ids = [reference.encode(p) for p in prompts]
    ref_out, cand_out = greedy(reference, ids, new_tokens), greedy(candidate, ids, new_tokens)
    worst = worst_rel = 0.0
    agree = positions = 0
    for prompt, cont in zip(ids, ref_out):
        text = prompt + cont
        a, b = (prefill_logits(e.executor.model, e.executor.config, text,
                               kv_dtype=e.executor.runner.kv_pool.dtype) for e in (reference, candidate))
        diff = (a - b).abs().amax(dim=-1)
        spread = a.amax(dim=-1) - a.amin(dim=-1)
        worst = max(worst, diff.max().item())
        worst_rel = max(worst_rel, (diff / spread).max().item())
        agree += (a.argmax(-1) == b.argmax(-1)).sum().item()
        positions += len(text)
    same_prefix = []
    for r, c in zip(ref_out, cand_out):
        n = next((i for i, (x, y) in enumerate(zip(r, c)) if x != y), min(len(r), len(c)))
        same_prefix.append(n)
    return {
        "prompts": len(prompts), "new_tokens": new_tokens,
        "max_abs_logit_diff": worst, "max_logit_diff_over_spread": worst_rel,
        "argmax_agreement": agree / positions,
        "identical_continuations": sum(r == c for r, c in zip(ref_out, cand_out)) / len(prompts),
        "mean_tokens_before_divergence": sum(same_prefix) / len(same_prefix),
        "tokens_before_divergence": same_prefix,
    }


def main() -> None:
    from pagedserve.engine import LLMEngine

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model directory or .gguf (off: the default model)")
    p.add_argument("--reference", default="auto", help="the float32 run's --linear-backend")
    p.add_argument("--candidate", action="append", choices=("int8", "int4"),
                   help="a --linear-backend to compare with the reference (repeatable; default: both)")
    p.add_argument("--new-tokens", type=int, default=32)
    args = p.parse_args()
    make = lambda b: LLMEngine(model=args.model, linear_backend=b, kv_tokens=4096, device="cpu",  # noqa: E731
                               dtype="float32")
    reference = make(args.reference)
    results = {b: compare(reference, make(b), PROMPTS, args.new_tokens) for b in args.candidate or ("int8", "int4")}
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
