"""`pagedserve bench kernels`: the cost of attending through block tables.

On the CPU, the torch paged path (the one the engine serves with) against dense
scaled_dot_product_attention over contiguous K/V of the same shapes, for a decode batch and
a prefill. On CUDA also the Triton kernel's achieved memory bandwidth against a plain copy.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import time


def add_parser(sub) -> None:
    p = sub.add_parser(
        "kernels",
        help="paged attention vs dense attention at the same shapes",
        description="Time pagedserve.kernels.paged_attention over a block-major pool (shuffled blocks, strided "
                    "layer views) against dense scaled_dot_product_attention over contiguous K/V "
                    "holding the same values: a decode batch (one query per sequence) and one "
                    "causal prefill, for each block size. Prints a table with the paged/dense "
                    "ratio, the cost of the indirection. With a CUDA device, also the Triton "
                    "kernel's achieved KV bandwidth against torch's copy bandwidth.",
    )
    p.add_argument("--num-seqs", type=int, default=32, help="decode batch size")
    p.add_argument("--context", type=int, default=512, help="context length of each decoding sequence")
    p.add_argument("--prefill-len", type=int, default=512, help="tokens of the prefill case")
    p.add_argument("--block-sizes", default="8,16,32", help="comma-separated block sizes")
    p.add_argument("--num-heads", type=int, default=9, help="query heads (SmolLM2-135M: 9)")
    p.add_argument("--num-kv-heads", type=int, default=3, help="KV heads (SmolLM2-135M: 3)")
    p.add_argument("--head-size", type=int, default=64)
    p.add_argument("--num-layers", type=int, default=4,
                   help="layers in the benchmark pool, so a layer's K/V is a strided view as in serving")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="CPU dtype")
    p.add_argument("--repeats", type=int, default=30, help="timed calls per measurement")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--cuda-num-seqs", type=int, default=256, help="CUDA decode batch size")
    p.add_argument("--cuda-context", type=int, default=2048, help="CUDA decode context length")
    p.add_argument("--cuda-dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--skip-cuda", action="store_true", help="CPU only, even with a CUDA device")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_results/kernels.json", help="JSON results file")
    p.set_defaults(run=run)


def paged_case(num_seqs, seq_len, q_len, block_size, args, dtype, device):
    """A pool with each sequence's blocks shuffled, its layer-1 views, and the same K/V dense."""
    import torch

    gen = torch.Generator(device=device).manual_seed(args.seed)
    per_seq = -(-seq_len // block_size)
    num_blocks = num_seqs * per_seq
    shape = (num_blocks, args.num_layers, 2, block_size, args.num_kv_heads, args.head_size)
    pool = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    layer = min(1, args.num_layers - 1)
    k_cache, v_cache = pool[:, layer, 0], pool[:, layer, 1]
    tables = torch.randperm(num_blocks, generator=gen, device=device).view(num_seqs, per_seq).to(torch.int32)
    ids = tables.long().flatten()

    def dense(cache):
        rows = cache[ids].view(num_seqs, per_seq * block_size, args.num_kv_heads, args.head_size)
        return rows[:, :seq_len].transpose(1, 2).contiguous()

    q = torch.randn(num_seqs * q_len, args.num_heads, args.head_size, generator=gen, device=device, dtype=dtype)
    return dict(
        q=q, k_cache=k_cache, v_cache=v_cache, block_tables=tables,
        seq_lens=torch.full((num_seqs,), seq_len, dtype=torch.int32, device=device),
        query_start_loc=torch.arange(0, num_seqs * q_len + 1, q_len, dtype=torch.int32, device=device),
        dense_k=dense(k_cache), dense_v=dense(v_cache),
    )


def timed(fns, repeats, sync=None):
    """Wall times in ms of each function, called in turn so that all see the same machine load."""
    for fn in fns:
        for _ in range(3):
            fn()
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, samples in zip(fns, times):
            if sync:
                sync()
            start = time.perf_counter()
            fn()
            if sync:
                sync()
            samples.append((time.perf_counter() - start) * 1e3)
    return times


def measure(name, case, q_len, block_size, args, sync=None):
    import torch
    import torch.nn.functional as F

    from pagedserve.kernels import paged_attention

    num_seqs, kv_heads, seq_len, head_size = case["dense_k"].shape
    scale = head_size ** -0.5
    q = case["q"]
    dense_q = q.view(num_seqs, q_len, args.num_heads, head_size).transpose(1, 2)
    out = torch.empty_like(q)

    def paged():
        paged_attention(q, case["k_cache"], case["v_cache"], case["block_tables"], case["seq_lens"],
                        case["query_start_loc"], scale, out=out)

    def dense():
        return F.scaled_dot_product_attention(dense_q, case["dense_k"], case["dense_v"], scale=scale,
                                              is_causal=q_len > 1, enable_gqa=True)

    paged()
    error = (out.float() - dense().transpose(1, 2).reshape(q.shape).float()).abs().max().item()
    paged_times, dense_times = timed([paged, dense], args.repeats, sync)
    paged_ms, dense_ms = statistics.median(paged_times), statistics.median(dense_times)
    kv_bytes = 2 * case["dense_k"].numel() * case["dense_k"].element_size()
    return {
        "case": name, "block_size": block_size, "num_seqs": num_seqs, "seq_len": seq_len, "q_len": q_len,
        "paged_ms": paged_ms, "paged_best_ms": min(paged_times), "dense_ms": dense_ms,
        "dense_best_ms": min(dense_times), "ratio": statistics.median(p / d for p, d in zip(paged_times, dense_times)),
        "ratio_of_bests": min(paged_times) / min(dense_times), "kv_bytes": kv_bytes,
        "paged_kv_gb_per_s": kv_bytes / paged_ms / 1e6, "dense_kv_gb_per_s": kv_bytes / dense_ms / 1e6,
        "max_abs_diff": error,
    }


def run_cpu(args, block_sizes):
    import torch

    dtype = getattr(torch, args.dtype)
    rows = []
    for block_size in block_sizes:
        case = paged_case(args.num_seqs, args.context, 1, block_size, args, dtype, "cpu")
        rows.append(measure("decode", case, 1, block_size, args))
        case = paged_case(1, args.prefill_len, args.prefill_len, block_size, args, dtype, "cpu")
        rows.append(measure("prefill", case, args.prefill_len, block_size, args))
    return rows


def run_cuda(args, block_sizes):
    import torch

    from pagedserve.kernels.paged_attention_triton import paged_attention_triton  # noqa: F401  (fails early without triton)

    dtype = getattr(torch, args.cuda_dtype)
    sync = torch.cuda.synchronize
    src = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = statistics.median(timed([lambda: dst.copy_(src)], args.repeats, sync)[0])
    copy_gb_per_s = 2 * src.numel() / copy_ms / 1e6
    del src, dst
    rows = []
    for block_size in block_sizes:
        case = paged_case(args.cuda_num_seqs, args.cuda_context, 1, block_size, args, dtype, "cuda")
        row = measure("decode", case, 1, block_size, args, sync)
        row["fraction_of_copy_bandwidth"] = row["paged_kv_gb_per_s"] / copy_gb_per_s
        rows.append(row)
        del case
        torch.cuda.empty_cache()
    return {"device": torch.cuda.get_device_name(), "dtype": args.cuda_dtype,
            "copy_gb_per_s": copy_gb_per_s, "rows": rows}


def print_rows(title, rows):
    """ms are medians, ratio the median of paired (back-to-back) calls; best: fastest paged/dense call."""
    print(title)
    print(f"{'case':8} {'block':>5} {'seqs x len':>11} {'paged ms':>9} {'dense ms':>9} {'ratio':>6} "
          f"{'best':>12} {'of bests':>8} {'paged GB/s':>10} {'max diff':>9}")
    for r in rows:
        bandwidth = f"{r['paged_kv_gb_per_s']:10.1f}" if r["q_len"] == 1 else f"{'-':>10}"
        print(f"{r['case']:8} {r['block_size']:5d} {r['num_seqs']:>4d} x {r['seq_len']:<4d} {r['paged_ms']:9.3f} "
              f"{r['dense_ms']:9.3f} {r['ratio']:6.2f} {r['paged_best_ms']:5.2f}/{r['dense_best_ms']:<6.2f} "
              f"{r['ratio_of_bests']:8.2f} {bandwidth} {r['max_abs_diff']:9.1e}")


def run(args) -> int:
    import torch

    block_sizes = [int(b) for b in args.block_sizes.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    machine = {"platform": platform.platform(), "processor": platform.processor(), "cpu_count": os.cpu_count(),
               "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
               "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
               "load_average_before": os.getloadavg()}
    results = {"machine": machine, "args": {k: v for k, v in vars(args).items() if k != "run"}}
    results["cpu"] = run_cpu(args, block_sizes)
    print_rows(f"CPU, {args.dtype}, {torch.get_num_threads()} threads "
               f"(heads {args.num_heads}/{args.num_kv_heads} kv, head size {args.head_size}):", results["cpu"])
    if torch.cuda.is_available() and not args.skip_cuda:
        cuda = run_cuda(args, block_sizes)
        results["cuda"] = cuda
        print_rows(f"\nCUDA {cuda['device']}, {cuda['dtype']} (torch copy: {cuda['copy_gb_per_s']:.0f} GB/s):",
                   cuda["rows"])
        for r in cuda["rows"]:
            print(f"  block {r['block_size']}: Triton decode reads KV at {r['paged_kv_gb_per_s']:.0f} GB/s, "
                  f"{r['fraction_of_copy_bandwidth']:.0%} of copy bandwidth")
    machine["load_average_after"] = os.getloadavg()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"\nwrote {args.out}")
    return 0
