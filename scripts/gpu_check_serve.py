"""gpu_check's `serve` part: `pagedserve bench serve` throughput through the services on a
random-weight 1B Llama shape (ShareGPT-like lengths, rates 4/16/inf) against transformers'
static batching.

gpu_check.py calls `part_serve(args, part, work)` with CUDA and `serve_without_cuda(args, part,
work)` without it (the commands' arguments parsed in a process of their own).
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from gpu_check_common import ROOT, child_env, parsed_without_cuda
from gpu_check_models import Services, build_model

if TYPE_CHECKING:
    from gpu_check import Part  # the runner's record of a part (no import at run time)


def sharegpt_like(n, seed=0, vocab=30000, max_total=2048):
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = min(int(rng.lognormvariate(5.0, 0.9)) + 4, 1024)
        o = min(int(rng.lognormvariate(5.0, 0.8)) + 4, max_total - p, 512)
        out.append(([rng.randrange(3, vocab) for _ in range(p)], max(o, 1)))
    return out


SERVE_RATES = ("4", "16", "inf")


def bench_serve_argv(gateway: str, n: int, rate: str, out: Path) -> list[str]:
    """`pagedserve bench serve` as the serve part runs it, after `python -m pagedserve.cli`."""
    return ["bench", "serve", "--server", gateway, "--workload", "sharegpt", "--num-requests", str(n),
            "--rate", rate, "--vocab", "30000", "--json", "--out", str(out)]


def part_serve(args, part: Part, work: Path):
    import torch

    model_dir = build_model(work / "llama-1b", hidden=2048, layers=16, heads=32, kv_heads=8, inter=8192,
                            vocab=32000, max_pos=4096, std=0.02, device=args.device, dtype=torch.bfloat16)
    torch.cuda.empty_cache()
    n = 32 if args.quick else 150
    rates_run = ("inf",) if args.quick else SERVE_RATES
    reqs = sharegpt_like(n)
    result = {"model": "random Llama 1B shape (2048x16, GQA 4, vocab 32k), bfloat16", "num_requests": n}
    svc = Services(model_dir, args.device, "bfloat16", log_dir=args.logs / "serve",
                   extra_memsvc=["--kv-memory", "40"]).start(timeout=min(240, max(1.0, part.left())))
    try:
        rates = {}
        for rate in rates_run:
            if part.over():
                part.put("reason", "time budget")
                break
            out = work / f"serve-{rate}.json"
            cmd = [sys.executable, "-m", "pagedserve.cli",
                   *bench_serve_argv(f"127.0.0.1:{svc.ports['gateway']}", n, rate, out)]
            done = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True,
                                  text=True, timeout=max(10, part.left()))
            rates[rate] = json.loads(out.read_text()) if out.exists() else {"error": done.stderr[-1500:]}
            part.put("pagedserve", rates)
        result["pagedserve"] = rates
        result["gateway_log_tail"] = svc.tail("gateway", 800)
    finally:
        svc.stop()
    # transformers static batching: batches of 16 in arrival order, left-padded
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(args.device).eval()
    with torch.inference_mode():  # a warm-up (cuBLAS's handles, the caching allocator) outside the timing
        model.generate(torch.tensor([[5, 6, 7]], device=args.device), max_new_tokens=4, do_sample=False,
                       pad_token_id=0)
    tokens, start, served = 0, time.perf_counter(), 0
    with torch.inference_mode():
        for i in range(0, min(len(reqs), 32 if args.quick else 64), 16):
            batch = reqs[i:i + 16]
            width = max(len(p) for p, _ in batch)
            ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in batch], device=args.device)
            mask = (torch.arange(width, device=args.device)[None, :] >= torch.tensor(
                [width - len(p) for p, _ in batch], device=args.device)[:, None]).long()
            new = max(o for _, o in batch)
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           pad_token_id=0)
            tokens += sum(o for _, o in batch)  # useful tokens only
            served += len(batch)
            if part.over():
                break
    torch.cuda.synchronize()
    result["transformers_static_batch16"] = {"useful_output_tokens_per_s": tokens / (time.perf_counter() - start),
                                             "requests": served}
    del model
    torch.cuda.empty_cache()
    result["status"] = "ok" if "inf" in result["pagedserve"] and "error" not in result["pagedserve"]["inf"] else "failed"
    return result


def serve_without_cuda(args, part: Part, work: Path):
    """No CUDA: the commands the serve part runs parse (gpu_check_common.parsed_without_cuda)."""
    return parsed_without_cuda(part, {f"bench serve --rate {rate}": bench_serve_argv(
        "127.0.0.1:50051", 4, rate, work / "serve.json") for rate in SERVE_RATES})
