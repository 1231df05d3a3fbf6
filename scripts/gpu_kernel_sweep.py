"""The decode kernel's launch settings, timed on one GPU: which tile, warps and pipeline stages
read the KV cache fastest (issue 26's reading: 128-wide tiles, 8 warps, more stages).

At the bench part's goal shape (256 sequences x 2k context, Llama-3-8B's heads, bf16, block 16),
each variant's time is set against the device-to-device copy bandwidth measured in the same
run, and its output against a float32 reference (gpu_check_attention.dense_reference; a
variant that is wrong is reported, not ranked). The best variants are then timed at the bench
part's other shapes beside the default. One JSON file (--out); the run stops starting new
variants at --budget seconds.

--splits instead times the split context's count (choose_splits' rule) on few long
sequences, where one program per (sequence, kv head) leaves most of the GPU idle: the host's
choice under each rule of RULES (the first: the rule before the H200 run), each count of
SPLIT_COUNTS forced, and dense SDPA on the same data, each launch replayed from a CUDA graph
(as the executor serves decodes), so the time is the GPU's and not the host's launch
(Triton's launcher costs ~50-100 us a call).

    python scripts/gpu_kernel_sweep.py --out $OUT/sweep.json [--budget 120] [--splits]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# (tile, num_warps, num_stages); None: the kernel's own choice. The default first, so a cut run
# still has the baseline.
VARIANTS = [(None, None, None), (128, 4, None), (128, 8, None), (64, 8, None), (32, 4, None),
            (64, 4, 2), (64, 4, 4), (128, 4, 2), (128, 4, 4), (128, 8, 3), (64, 2, None), (128, 8, 4)]
GOAL_SHAPE = (256, 2048, 32, 8, 128, 16)  # seqs, context, heads, kv heads, head size, block
OTHER_SHAPES = [(32, 8192, 32, 8, 128, 16), (4, 8192, 32, 8, 128, 16), (256, 2048, 32, 8, 128, 32),
                (64, 2048, 16, 16, 64, 16)]


SPLIT_SHAPES = [(1, 32768, 32, 8, 128, 16), (4, 8192, 32, 8, 128, 16), (8, 8192, 32, 8, 128, 16),
                (16, 4096, 32, 8, 128, 16), (32, 8192, 32, 8, 128, 16), (64, 2048, 32, 8, 128, 16),
                (32, 2048, 32, 8, 64, 16), (128, 2048, 32, 8, 128, 16),
                (256, 2048, 32, 8, 128, 16)]
RULES = [(2, 2), (4, 4), (4, 8)]  # (SPLIT_BELOW, FILL_WAVES) of pagedserve.kernels.paged_attention_triton
SPLIT_COUNTS = [1, 2, 4, 8, 16, 32]


def name(variant) -> str:
    tile, warps, stages = variant
    return f"tile={tile or 'auto'} warps={warps or 'auto'} stages={stages or 'auto'}"


def measure(torch, shape, variant, copy_gbs, check=False, splits=None, a=None, graphs=False):
    from gpu_check_attention import dense_reference, graph_timed, make_paged, timed

    from pagedserve.kernels.paged_attention_triton import paged_attention_triton

    seqs, context, heads, kv, head, block = shape
    if a is None:
        a = make_paged(torch, seqs, context, 1, heads, kv, head, block, torch.bfloat16, "cuda")
    tile, warps, stages = variant
    run = lambda: paged_attention_triton(**a, scale=head ** -0.5, tile=tile, num_warps=warps,  # noqa: E731
                                         num_stages=stages, num_splits=splits)
    row = {"variant": name(variant), "shape": dict(zip(("seqs", "context", "heads", "kv_heads", "head", "block"),
                                                        shape)), "splits": splits or "auto"}
    if check:
        ref = dense_reference(torch, a, head ** -0.5)
        out = run().float()
        row["rel_l2"] = ((out - ref).norm() / ref.norm()).item()
        row["correct"] = bool(torch.isfinite(out).all()) and row["rel_l2"] <= 2e-2
    seconds = graph_timed(torch, run) if graphs else timed(torch, run, 50)
    gbs = 2 * seqs * context * kv * head * 2 / seconds / 1e9
    row.update(ms=seconds * 1e3, gb_per_s=gbs, fraction_of_copy=gbs / copy_gbs)
    return row


def split_rows(torch, copy_gbs, start, args, report) -> None:
    """The --splits rows, into report["splits"] (written as each shape ends)."""
    from gpu_check import write
    from gpu_check_attention import dense_decode, graph_timed, make_paged

    import pagedserve.kernels.paged_attention_triton as pat

    rows = report.setdefault("splits", [])
    for shape in SPLIT_SHAPES:
        if time.monotonic() - start > args.budget:
            report["cut"] = f"budget {args.budget:.0f}s: shapes from {shape} not run"
            break
        seqs, context, heads, kv, head, block = shape
        a = make_paged(torch, seqs, context, 1, heads, kv, head, block, torch.bfloat16, "cuda")
        rule = pat.SPLIT_BELOW, pat.FILL_WAVES
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        programs = (seqs // pat.launch_config(seqs, seqs, heads // kv, block, head)["block_q"] + seqs) * kv
        for below, waves in RULES:
            pat.SPLIT_BELOW, pat.FILL_WAVES = below, waves
            rows.append({**measure(torch, shape, VARIANTS[0], copy_gbs, check=(below, waves) == RULES[0], a=a,
                                 graphs=True),
                         "splits": f"auto, SPLIT_BELOW={below} FILL_WAVES={waves}: "
                                   f"{pat.choose_splits(programs, context, True, sms)}"})
        pat.SPLIT_BELOW, pat.FILL_WAVES = rule
        rows += [measure(torch, shape, VARIANTS[0], copy_gbs, splits=count, a=a, graphs=True)
                 for count in SPLIT_COUNTS]
        dense = graph_timed(torch, dense_decode(torch, a, head ** -0.5))
        rows.append({"variant": "dense SDPA", "shape": rows[-1]["shape"], "splits": "-", "ms": dense * 1e3,
                     "fraction_of_copy": 2 * seqs * context * kv * head * 2 / dense / 1e9 / copy_gbs})
        del a
        for row in rows[-(len(RULES) + len(SPLIT_COUNTS) + 1):]:
            print(json.dumps(row), flush=True)
        write(report, args.out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="the JSON file to write")
    p.add_argument("--budget", type=float, default=120.0, help="seconds after which no new variant starts")
    p.add_argument("--splits", action="store_true", help="time the split count on few long sequences instead")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "scripts"))
    import torch
    from gpu_check import write
    from gpu_check_attention import copy_gb_per_s

    start = time.monotonic()
    copy_gbs = copy_gb_per_s(torch)
    report = {"gpu": torch.cuda.get_device_name(), "copy_gb_per_s": copy_gbs, "goal_shape": [], "other_shapes": []}
    if args.splits:
        split_rows(torch, copy_gbs, start, args, report)
        report["seconds"] = time.monotonic() - start
        write(report, args.out)
        return 0
    for variant in VARIANTS:
        if time.monotonic() - start > args.budget:
            report["cut"] = f"budget {args.budget:.0f}s: {name(variant)} and later not run"
            break
        try:
            row = measure(torch, GOAL_SHAPE, variant, copy_gbs, check=True)
        except Exception as e:  # noqa: BLE001 - a variant Triton refuses (registers, shared memory) is recorded
            row = {"variant": name(variant), "error": f"{type(e).__name__}: {str(e)[:300]}"}
        report["goal_shape"].append(row)
        print(json.dumps(row), flush=True)
        write(report, args.out)
    ranked = sorted((r for r in report["goal_shape"] if r.get("correct")), key=lambda r: r["ms"])
    report["best"] = [r["variant"] for r in ranked[:3]]
    best = [v for v in VARIANTS if name(v) in report["best"][:2] and v != VARIANTS[0]]
    for shape in OTHER_SHAPES:
        for variant in [VARIANTS[0], *best]:
            if time.monotonic() - start > args.budget * 1.5:
                break
            row = measure(torch, shape, variant, copy_gbs)
            report["other_shapes"].append(row)
            print(json.dumps(row), flush=True)
    report["seconds"] = time.monotonic() - start
    write(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
