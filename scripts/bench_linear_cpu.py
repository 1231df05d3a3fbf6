"""Time the CPU linear backends (MKL's F.linear, oneDNN prepacked, the C++ "dot" kernel of
pagedserve/kernels/linear_cpu.py, the C++ "panel" kernel of pagedserve/kernels/panel_cpu.py) on the default model's layer shapes (SmolLM2-135M: 30
layers of 960x576, 576x576, 3072x576, 576x1536, and the 49152x576 LM head), each layer its
own random weights, so that every call meets its weight out of the cache as a decode step
does; the backends alternate, best and median of several rounds (a round: one call per layer).
The gate/up shape also times "dot" and "panel" with SiLU-and-multiply applied to their sums
(dot_silu, panel_silu).

    .venv/bin/python scripts/bench_linear_cpu.py [--rows 1,64,512,2048] [--out FILE.json]
    .venv/bin/python scripts/bench_linear_cpu.py --rows 64 --backends dot --baseline-rev REV --rounds 16

--baseline-rev times the C++ kernel of that git revision beside this one (dot@REV). Prints
GFLOP/s per shape, row count and backend, and writes them to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pagedserve.benchmarks.revision import module_at  # noqa: E402
from pagedserve.executor.linear import BACKENDS, PACKED, Linear  # noqa: E402
from pagedserve.kernels import linear_cpu, panel_cpu  # noqa: E402
from pagedserve.wire.cpu_info import cpu_info  # noqa: E402

SHAPES = {(960, 576): 30, (576, 576): 30, (3072, 576): 30, (576, 1536): 30, (49152, 576): 3}
MAX_FLOP = 2e10  # per shape and row count, one round over its layers at most this much
GATE_UP = (3072, 576)


def baseline(rev: str) -> dict:
    """The linear_cpu module of git revision `rev`, its kernel built (keyed by its own source)."""
    module = module_at(rev, "pagedserve/kernels/linear_cpu.py")
    if module["_native"].get() is None:
        raise SystemExit(f"the C++ linear kernel of {rev} does not build")
    return module


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,64,512,2048", help="comma-separated row counts")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--backends", default="mkl,onednn,dot,panel", help="comma-separated, among mkl, onednn, dot, panel")
    p.add_argument("--baseline-rev", help="also time the C++ kernel of this git revision (dot@REV)")
    p.add_argument("--out", default="bench_results/linear_cpu.json")
    args = p.parse_args()
    if (why := linear_cpu.unavailable_for("cpu", torch.float32)) is not None:
        raise SystemExit(why)
    cpu = cpu_info()
    backends = args.backends.split(",")
    if unknown := set(backends) - {"mkl", "onednn", "dot", "panel"}:
        raise SystemExit(f"--backends: {', '.join(sorted(unknown))} unknown; choose among mkl, onednn, dot, panel")
    packed = [b for b in BACKENDS if b in PACKED and b in backends]
    base = baseline(args.baseline_rev) if args.baseline_rev else None
    print(f"cpu {cpu['model_name']} [{' '.join(cpu['isa'])}], {torch.get_num_threads()} threads")
    results = []
    for (n, k), layers in SHAPES.items():
        weights = [Linear(torch.randn(n, k) * 0.05) for _ in range(layers)]
        for w in weights if packed else []:  # each copy made (run() names the backend); the dense weight stays
            w.route([(1, b) for b in packed[1:]] + [(None, packed[0])])
        for m in map(int, args.rows.split(",")):
            use = max(1, min(layers, int(MAX_FLOP // (2 * m * n * k))))
            x = torch.randn(m, k)
            calls = {b: (lambda i, b=b: weights[i].run(b, x)) for b in backends}
            if base is not None:
                calls[f"dot@{args.baseline_rev}"] = lambda i: base["matmul"](x, weights[i].weight)
            if (n, k) == GATE_UP and "dot" in backends:
                calls["dot_silu"] = lambda i: linear_cpu.matmul_silu(x, weights[i].weight)
                if base is not None:
                    calls[f"dot_silu@{args.baseline_rev}"] = lambda i: base["matmul_silu"](x, weights[i].weight)
            if (n, k) == GATE_UP and "panel" in backends:
                calls["panel_silu"] = lambda i: panel_cpu.matmul_silu(x, weights[i].prepared["panel"])
            times = {name: [] for name in calls}
            for r in range(args.rounds):
                for name, call in (calls.items() if r % 2 == 0 else reversed(calls.items())):
                    t = time.perf_counter()
                    for i in range(use):
                        call(i)
                    times[name].append((time.perf_counter() - t) / use)
            flop = 2 * m * n * k
            gflops = {b: flop / min(ts) / 1e9 for b, ts in times.items()}
            median = {b: flop / statistics.median(ts) / 1e9 for b, ts in times.items()}
            results.append({"shape": [n, k], "rows": m, "layers": use, "gflops": gflops, "median_gflops": median})
            print(f"{n}x{k} M={m}: " + "  ".join(f"{b} {gflops[b]:.1f} / {median[b]:.1f}" for b in calls)
                  + " GFLOP/s (best / median round)")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"cpu": cpu, "threads": torch.get_num_threads(), "baseline_rev": args.baseline_rev,
                   "results": results}, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
