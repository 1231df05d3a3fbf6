"""Decode attention on the CPU against the memory bandwidth (issue 44): the machine's copy
bandwidth (a large torch copy; bytes read per second) and the C++ decode kernel's effective
K/V read bandwidth (K/V bytes of every sequence's context / time), timed alternately in one
process (a copy, then a step of each kernel, repeated; medians), with their ratio, for each
build target asked for (native; haswell, the AVX2-only build) and block size; with
--baseline-rev, the decode kernel of that git revision side by side.

The setup is a decode step of a 30-layer model with SmolLM2-135M's attention (9 query heads, 3
kv heads of 64, float32): a block-major pool [blocks, layers, 2, block, kv_heads, head] with
each sequence's blocks shuffled, the kernel called once per layer in order, so a layer's K/V
is not in the cache when it is read (the pool is capped at --pool-gb: fewer layers at long
contexts). Times are medians of --repeats steps, per layer.

    flock /tmp/pagedserve-bench.lock nice -n 19 .venv/bin/python scripts/bench_decode_cpu.py \
        --out bench_results/decode_cpu.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from pagedserve.benchmarks.cpu_info import cpu_info, describe
from pagedserve.benchmarks.revision import module_at
from pagedserve.kernels import native_build, paged_decode_cpu

NUM_HEADS, KV_HEADS, HEAD = 9, 3, 64


def decode_case(batch: int, context: int, block_size: int, layers: int, repeats: int, seed: int,
                kernels: dict, copy_bytes: int, dtype: torch.dtype) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    per_seq = math.ceil(context / block_size)
    blocks = batch * per_seq
    pool = torch.empty(blocks, layers, 2, block_size, KV_HEADS, HEAD, dtype=dtype)
    pool.normal_(generator=gen)
    tables = torch.randperm(blocks, generator=gen).view(batch, per_seq).to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32)
    rows = torch.arange(batch, dtype=torch.int64)
    q = torch.randn(batch, NUM_HEADS, HEAD, generator=gen)
    out = torch.empty_like(q)
    scale = HEAD ** -0.5
    views = [(pool[:, layer, 0], pool[:, layer, 1]) for layer in range(layers)]

    src = torch.ones(copy_bytes // 4)
    dst = torch.empty_like(src)

    def step(lib):
        paged_decode_cpu._native = native_build.Library(lambda: lib)
        for k, v in views:
            paged_decode_cpu.paged_decode(q, k, v, tables, lens, rows, scale, out)

    for lib in kernels.values():
        step(lib)
    times, copies = {name: [] for name in kernels}, []
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        copies.append(time.perf_counter() - t)
        for name, lib in kernels.items():
            t = time.perf_counter()
            step(lib)
            times[name].append((time.perf_counter() - t) / layers)
    kv_bytes = 2 * batch * context * KV_HEADS * HEAD * pool.element_size()
    copy = copy_bytes / statistics.median(copies) / 1e9
    result = []
    for name, ts in times.items():
        ms = statistics.median(ts) * 1e3
        result.append({"kernel": name, "kv_dtype": str(dtype).removeprefix("torch."), "batch": batch, "context": context, "block_size": block_size,
                       "layers": layers, "kv_bytes_per_layer": kv_bytes, "ms_per_layer": ms,
                       "best_ms_per_layer": min(ts) * 1e3, "ms_per_30_layers": 30 * ms,
                       "kv_gb_per_s": kv_bytes / ms / 1e6, "copy_gb_per_s": copy,
                       "fraction_of_copy": kv_bytes / ms / 1e6 / copy})
    return result


def build(march: str, baseline_rev: str | None) -> dict:
    """{name: library} of the decode kernel built for -march=<march> (native: the default),
    and of the one at baseline_rev (git) when given; {} if the kernel does not build."""
    if march == "native":
        os.environ.pop("PAGEDSERVE_NATIVE_MARCH", None)
    else:
        os.environ["PAGEDSERVE_NATIVE_MARCH"] = march
    kernels = {"this": paged_decode_cpu._build()}
    if baseline_rev:
        module = module_at(baseline_rev, "pagedserve/kernels/paged_decode_cpu.py")
        kernels[baseline_rev] = native_build.load("paged_attention_cpu_baseline", module["SOURCE"])
        if kernels[baseline_rev] is not None:
            paged_decode_cpu.set_argtypes(kernels[baseline_rev])
    return kernels if all(kernels.values()) else {}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--contexts", default="128,256,1024,2048")
    p.add_argument("--block-sizes", default="16")
    p.add_argument("--marches", default="native,haswell", help="build targets (-march=); native is the default")
    p.add_argument("--kv-dtypes", default="float32", help="cache dtypes: float32, bfloat16 (the baseline: float32 only)")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--pool-gb", type=float, default=2.0, help="cap on the pool's size: fewer layers past it")
    p.add_argument("--copy-mb", type=int, default=512)
    p.add_argument("--baseline-rev", default=None, help="git revision whose decode kernel is timed alongside")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_results/decode_cpu.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    info = cpu_info()
    print(f"decode attention, batch {args.batch}, {NUM_HEADS}/{KV_HEADS} heads of {HEAD}, float32, "
          f"{args.threads} threads ({describe(info)})")
    rows = []
    for march in args.marches.split(","):
        kernels = build(march, args.baseline_rev)
        if not kernels:
            print(f"the decode kernel did not build for -march={march}", file=sys.stderr)
            return 1
        for dtype, bs in itertools.product(args.kv_dtypes.split(","), map(int, args.block_sizes.split(","))):
            kv_dtype = getattr(torch, dtype)
            mine = kernels if kv_dtype == torch.float32 else {"this": kernels["this"]}
            for context in map(int, args.contexts.split(",")):
                layer_bytes = args.batch * math.ceil(context / bs) * bs * 2 * KV_HEADS * HEAD * 4
                layers = max(2, min(args.layers, int(args.pool_gb * 1e9 // layer_bytes)))
                for r in decode_case(args.batch, context, bs, layers, args.repeats, args.seed, mine,
                                     args.copy_mb << 20, kv_dtype):
                    r["march"] = march
                    rows.append(r)
                    print(f"{march:>8} {r['kernel']:>8} {dtype:>8} block {bs:3d} context {context:5d} ({layers:2d} layers): "
                          f"{r['ms_per_layer']:7.3f} ms a layer ({r['ms_per_30_layers']:7.2f} per 30), "
                          f"K/V {r['kv_gb_per_s']:5.1f} GB/s, copy {r['copy_gb_per_s']:5.1f} GB/s: "
                          f"{r['fraction_of_copy']:4.0%}", flush=True)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"cpu": info, "threads": args.threads, "baseline_rev": args.baseline_rev,
                   "load_average": os.getloadavg(), "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
