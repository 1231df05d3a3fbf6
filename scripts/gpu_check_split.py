"""gpu_check's `split` part: what the split into three services costs per step on a GPU, where
the step itself is a few milliseconds (issue 24; docs/ARCHITECTURE.md, "The step path").

`pagedserve bench split` on the serve part's model (random Llama 1B shape, bfloat16), twice:
  - a batch: 32 requests of 128 tokens in, 64 out, one round;
  - one stream: 1 request (max one sequence a step), 128 in, 64 out, five rounds (the
    median; on an H200 three rounds of the gateway ranged 2.3-3.1 ms a step): issue 24's
    "one stream served" against the in-process engine's step.
Each reports ms per step in process, through the gateway and in the split loops, and the ms
per step beyond the executor's own Execute time. The numbers are recorded, not judged: `ok`
means both runs finished. Without CUDA, the commands' arguments are parsed (the rehearsal).
gpu_check.py calls `part_split(args, part, work, build_model)`.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNS = {"batch_32": dict(requests=32, max_seqs=32, rounds=1), "one_stream": dict(requests=1, max_seqs=1, rounds=5)}
KV_GIB = 12  # each pool: memsvc's and the in-process engine's, side by side on one GPU


def bench_split_argv(model_dir, device: str, out: Path, requests: int, max_seqs: int, rounds: int) -> list[str]:
    """`pagedserve bench split` as this part runs it, after `python -m pagedserve.cli`."""
    return ["bench", "split", "--model", str(model_dir), "--device", device, "--dtype", "bfloat16",
            "--num-requests", str(requests), "--max-num-seqs", str(max_seqs), "--input-len", "128",
            "--output-len", "64", "--rounds", str(rounds), "--kv-memory", str(KV_GIB), "--out", str(out)]


def summary(result: dict) -> dict:
    """The figures worth keeping from bench split's JSON: ms per step of each kind's median
    run, each against the in-process step, and the overhead beyond Execute."""
    step = {kind: sorted(r["step_ms"] for r in runs)[len(runs) // 2] for kind, runs in result["runs"].items()}
    return {"step_ms": step, "step_vs_in_process": result["step_vs_in_process"],
            "overhead_ms": result["overhead_ms"], "gateway_vs_in_process": result["gateway_vs_in_process"]}


def part_split(args, part, work: Path, build_model) -> dict:
    import torch

    if not torch.cuda.is_available():
        return split_without_cuda(part, work)
    from gpu_check_common import child_env

    model_dir = build_model(work / "llama-1b", hidden=2048, layers=16, heads=32, kv_heads=8, inter=8192,
                            vocab=32000, max_pos=4096, std=0.02, device=args.device, dtype=torch.bfloat16)
    torch.cuda.empty_cache()
    done_all = True
    for name, run in RUNS.items():
        if part.over():
            part.put("reason", f"time budget, before {name}")
            return {"status": "failed"}
        out = work / f"split-{name}.json"
        argv = bench_split_argv(model_dir, args.device, out, run["requests"], run["max_seqs"], run["rounds"])
        done = subprocess.run([sys.executable, "-m", "pagedserve.cli", *argv], cwd=ROOT, env=child_env(),
                              capture_output=True, text=True, timeout=max(30, part.left() + 30))
        if out.exists():
            part.put(name, {**summary(json.loads(out.read_text())), "printed": done.stdout[-1500:]})
        else:
            done_all = False
            part.put(name, {"error": done.stderr[-2000:]})
    return {"status": "ok" if done_all else "failed"}


def split_without_cuda(part, work: Path) -> dict:
    """No CUDA: the commands parse (gpu_check_common.parsed_without_cuda)."""
    from gpu_check_common import parsed_without_cuda

    return parsed_without_cuda(part, {
        name: bench_split_argv(work / "llama-1b", "cuda", work / f"split-{name}.json", run["requests"],
                               run["max_seqs"], run["rounds"]) for name, run in RUNS.items()})
