"""`pagedserve bench sampler`: what the sampler costs a step, per sampling mode and batch size.

Random logits over the default model's vocabulary, every row with the same sampling
parameters, one thread (as a share of a CPU step's cores: a decode step at batch 64 on a
2-core machine takes ~160 ms). Median wall ms over the repeats. See docs/ARCHITECTURE.md,
"The step path" (the sampler's place in a step).
"""
from __future__ import annotations

import json
import os
import statistics
import time

MODES = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=0.7),
    "top_p": dict(temperature=0.7, top_p=0.9),
    "top_k": dict(temperature=0.7, top_k=50),
    "top_k+top_p": dict(temperature=0.7, top_k=50, top_p=0.9),
    "logprobs": dict(temperature=0.7, logprobs=5),
}


def add_parser(sub) -> None:
    p = sub.add_parser("sampler", help="the sampler's cost per step, per sampling mode",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", default="8,64,256", help="comma-separated batch sizes")
    p.add_argument("--vocab", type=int, default=49152, help="logits per row (the default model's vocabulary)")
    p.add_argument("--repeats", type=int, default=7, help="timed calls per mode and size")
    p.add_argument("--out", default="bench_results/sampler.json", help="JSON results file")
    p.set_defaults(run=run)


def measure(batch: int, vocab: int, mode: dict, repeats: int) -> float:
    import numpy as np
    import torch

    from pagedserve.executor.sampler import Sampler
    from pagedserve.step.whole_seqs import Seq, batch_of
    from pagedserve.wire.protocol import SamplingParams

    sampling = SamplingParams(**mode)
    step = batch_of([Seq(f"s{i}", [1], 8, [0], sampling=sampling, seed=i) for i in range(batch)], 16)
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(batch)) * 3
    rows, sampler = np.arange(batch), Sampler()
    sampler(logits, step, rows)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        sampler(logits, step, rows)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def run(args) -> int:
    import torch

    from pagedserve.benchmarks.cpu_info import cpu_info, describe

    torch.set_num_threads(1)
    sizes = [int(x) for x in args.batch_sizes.split(",") if x.strip()]
    results = {name: {str(b): measure(b, args.vocab, mode, args.repeats) for b in sizes}
               for name, mode in MODES.items()}
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"cpu": cpu_info(), "vocab": args.vocab, "ms": results}, f, indent=1)
    print(f"sampler ms per step, vocabulary {args.vocab}, one thread ({describe(cpu_info())})")
    print("mode".ljust(14) + "".join(f"B={b}".rjust(10) for b in sizes))
    for name, by_size in results.items():
        print(name.ljust(14) + "".join(f"{by_size[str(b)]:10.2f}" for b in sizes))
    return 0
