"""Time the fused CPU ops (pagedserve/kernels/fused_cpu.py) alone against the torch code they replace,
with the shapes of a decode step of the default model (SmolLM2-135M: hidden 576, 9 heads and
3 KV heads of 64, 30 layers), at T=1 and T=64 tokens.

    .venv/bin/python scripts/bench_fused_ops.py [--tokens 1,64] [--out FILE.json]
    .venv/bin/python scripts/bench_fused_ops.py --steps [--batches 1,64] [--rounds 8]

Prints microseconds per call (median of several timed loops) and, per decode step, the sum
over the 30 layers of what each op would save. With --steps, times whole decode steps of the
engine instead, the fused ops on and off alternating every few steps in one process (so that
the machine's drift hits both alike), for each batch size.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pagedserve.kernels import fused_cpu, rotary_store_cpu  # noqa: E402
from pagedserve.kernels.paged_cpu import store_kv_cpu  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, LAYERS, EPS = 576, 9, 3, 64, 30, 1e-5
INTERMEDIATE = 1536


def torch_rms_norm(x, w):  # pagedserve/executor/models/llama.py rms_norm, float32
    scale = x.pow(2).mean(-1, keepdim=True).add_(EPS).rsqrt_()
    return (x * scale).mul_(w)


def torch_rotary(x, cos, sin):  # pagedserve/executor/models/llama.py apply_rotary
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def cases(t: int):
    g = torch.Generator().manual_seed(t)
    x, a = torch.randn(t, HIDDEN, generator=g), torch.randn(t, HIDDEN, generator=g)
    w = torch.randn(HIDDEN, generator=g)
    qkv = torch.randn(t, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=g)
    qk = qkv[:, : (HEADS + KV_HEADS) * HEAD_DIM].view(t, HEADS + KV_HEADS, HEAD_DIM)
    angles = torch.rand(t, HEAD_DIM // 2, generator=g) * 100  # unit rotations: repeated calls stay finite
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    gate_up = torch.randn(t, 2 * INTERMEDIATE, generator=g)
    gate, up = gate_up.chunk(2, dim=-1)
    gate.zero_()  # silu_and_mul_ writes silu(gate) * up over the gate: at 0 every call sees the same input
    pool = torch.zeros(t + 16, 4, 2, 16, KV_HEADS, HEAD_DIM)  # 16-token blocks, 4 layers
    k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]
    slots = torch.arange(t, dtype=torch.int64) * 16  # one token a block, as a decode batch
    v = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM:].view(t, KV_HEADS, HEAD_DIM)

    def rotary_then_store():  # pagedserve/executor/models/llama.py before: the fused rotary, then store_kv
        fused_cpu.rotary_(qk, cos, sin)
        store_kv_cpu(qk[:, HEADS:], v, k_cache, v_cache, slots)

    return {
        "rms_norm": (lambda: torch_rms_norm(x, w), lambda: fused_cpu.rms_norm(x, w, EPS)),
        # the torch side adds out of place (the layer's x is its caller's); the fused one in place
        "add_rms_norm": (lambda: torch_rms_norm(x + a, w), lambda: fused_cpu.add_rms_norm_(a, x, w, EPS)),
        "rotary": (lambda: torch_rotary(qk, cos, sin), lambda: fused_cpu.rotary_(qk, cos, sin)),
        # pagedserve/executor/models/llama.py DecoderLayer.mlp's torch path
        "silu_and_mul": (lambda: torch.nn.functional.silu(gate).mul_(up), lambda: fused_cpu.silu_and_mul_(gate_up)),
        # against the C++ rotary and store_kv's index_copy_ it replaces
        "rotary_store": (rotary_then_store, lambda: rotary_store_cpu.rotary_store_kv_(
            qk, v, cos, sin, k_cache, v_cache, slots)),
    }


def time_us(fn, loops: int, repeats: int = 7) -> float:
    for _ in range(loops // 10 + 1):
        fn()
    best = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(loops):
            fn()
        best.append((time.perf_counter() - t0) / loops * 1e6)
    best.sort()
    return best[len(best) // 2]


def decode_steps(batches, rounds: int, per_round: int = 4) -> list[dict]:
    """Median decode step time with the fused ops on and off, alternated in one engine."""
    import random

    from pagedserve.engine import LLMEngine
    from pagedserve.wire.protocol import SamplingParams

    engine, results = LLMEngine(), []
    steps = 2 * rounds * per_round + 2
    for batch in batches:
        rng = random.Random(batch)
        for i in range(batch):
            engine.add_request([rng.randrange(1000, 20000) for _ in range(128)],
                               SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True),
                               request_id=f"{batch}-{i}")
        loop, times = engine.loop, {True: [], False: []}
        while len(loop.scheduler.running) < batch or loop.scheduler.waiting:
            loop.step()  # the prefills
        loop.step()
        natives = [(n, n.get()) for n in (fused_cpu._native, rotary_store_cpu._native)]
        for r in range(2 * rounds):
            on = r % 2 == (r // 2) % 2  # on, off, off, on, on, off, ...
            for native, lib in natives:
                native._lib = lib if on else None  # (built: get() returns what is set)
            for _ in range(per_round):
                t0 = time.perf_counter()
                loop.step()
                times[on].append(time.perf_counter() - t0)
        for native, lib in natives:
            native._lib = lib
        while loop.has_work():
            loop.step()
        row = {"batch": batch, "steps_each": len(times[True])}
        for on, name in ((True, "fused"), (False, "torch")):
            ts = sorted(times[on])
            row[name + "_ms_median"] = ts[len(ts) // 2] * 1e3
            row[name + "_ms_all"] = [t * 1e3 for t in times[on]]
        results.append(row)
        print(f"batch {batch:3d}: decode step {row['fused_ms_median']:.1f} ms fused, "
              f"{row['torch_ms_median']:.1f} ms torch (medians of {row['steps_each']} steps each, "
              f"alternated); {row['torch_ms_median'] / row['fused_ms_median']:.3f}x")
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,64")
    ap.add_argument("--loops", type=int, default=300)
    ap.add_argument("--out", default=None)
    ap.add_argument("--steps", action="store_true", help="time engine decode steps instead")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    assert fused_cpu.available(), "the fused kernels did not build"
    results = {"threads": torch.get_num_threads(), "cpus": os.cpu_count(), "runs": []}
    if args.steps:
        results["steps"] = decode_steps([int(b) for b in args.batches.split(",")], args.rounds)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
        return 0
    print(f"torch threads {torch.get_num_threads()}, {os.cpu_count()} CPUs; us per call (median)")
    print(f"{'op':14s} {'T':>4s} {'torch':>9s} {'fused':>9s} {'ratio':>7s} {'saved/step ms':>14s}")
    with torch.inference_mode():
        for t in (int(s) for s in args.tokens.split(",")):
            for name, (ref, fused) in cases(t).items():
                a, b = time_us(ref, args.loops), time_us(fused, args.loops)
                per_step = (a - b) * LAYERS / 1e3  # each op once per layer
                results["runs"].append({"op": name, "tokens": t, "torch_us": a, "fused_us": b})
                print(f"{name:14s} {t:4d} {a:9.1f} {b:9.1f} {a / b:6.2f}x {per_step:14.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
