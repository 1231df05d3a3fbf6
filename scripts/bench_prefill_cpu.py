"""Prefill attention on the CPU: the C++ kernel that reads the pool in place
(pagedserve/kernels/paged_prefill_cpu.py) against the reference path it replaced (a gather and an SDPA
call per sequence, kernels/paged_attention_ref._prefill), alternated in one process, medians.
The default model's attention shape (9 query heads, 3 kv heads of 64), block size 16, one layer.

    .venv/bin/python scripts/bench_prefill_cpu.py --out bench_results/prefill_cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from pagedserve.benchmarks.cpu_info import cpu_info, describe
from pagedserve.kernels import paged_prefill_cpu
from pagedserve.kernels.paged_attention_ref import _prefill
from tests.unit.kernels.test_kernels_attention import make_batch

CASES = {"8 x 128": [(128, 128)] * 8, "4 x 100 after 200 cached": [(300, 100)] * 4, "1 x 512": [(512, 512)],
         "4 x 512": [(512, 512)] * 4, "1 x 1024": [(1024, 1024)], "1 x 2048": [(2048, 2048)],
         "1 x 4096": [(4096, 4096)]}


def measure(specs, repeats: int) -> dict:
    args, _, _ = make_batch(specs, 16, 3, 3, 64)
    q, kc, vc, bt = args["q"], args["k_cache"], args["v_cache"], args["block_tables"]
    starts, lens = args["query_start_loc"].tolist(), args["seq_lens"].tolist()
    chunks = [(b, starts[b], starts[b + 1], lens[b]) for b in range(len(specs))]
    table, items = torch.tensor(chunks, dtype=torch.int64), paged_prefill_cpu.work_items(chunks, 3, 3)
    old_out, new_out = torch.empty_like(q), torch.empty_like(q)

    def old():
        for b, s, e, n in chunks:
            _prefill(q, kc, vc, bt[b], n, s, e, 0.125, True, old_out)

    def new():
        paged_prefill_cpu.paged_prefill(q, kc, vc, bt, table, items, 0.125, new_out)

    old(), new()
    times = {"old": [], "new": []}
    for _ in range(repeats):
        for name, fn in (("old", old), ("new", new)):
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    tokens = sum(s[1] for s in specs)
    o, n = statistics.median(times["old"]) * 1e3, statistics.median(times["new"]) * 1e3
    return {"gather_sdpa_ms": o, "in_place_ms": n, "speedup": o / n, "us_per_token_old": o * 1e3 / tokens,
            "us_per_token_new": n * 1e3 / tokens, "max_abs_diff": (old_out - new_out).abs().max().item()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="bench_results/prefill_cpu.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if not paged_prefill_cpu.native_available():
        print("the C++ prefill kernel did not build here", file=sys.stderr)
        return 1
    rows = {}
    print(f"prefill attention, one layer, {args.threads} threads ({describe(cpu_info())})")
    for name, specs in CASES.items():
        r = rows[name] = measure(specs, args.repeats)
        print(f"  {name:26s} gather+SDPA {r['gather_sdpa_ms']:7.2f} ms  in place {r['in_place_ms']:7.2f} ms  "
              f"{r['speedup']:.2f}x  ({r['us_per_token_old']:.1f} -> {r['us_per_token_new']:.1f} us a token)")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"cpu": cpu_info(), "threads": args.threads, "cases": rows}, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
