"""gpu_check's `tp` part: tensor parallelism (issue 29; docs/ARCHITECTURE.md, "Tensor
parallelism"), run only where the machine has 2 or more GPUs.

- Fewer than 2 GPUs (or no CUDA): "skipped", with a reason that says the part did not run
  and how many GPUs there are.
- nccl: all-reduce between 2 GPUs, 2 processes (`python scripts/gpu_check_tp.py
  --nccl-worker RANK PORT OUT`), bfloat16, at the sizes of one step's row-parallel sums
  (tokens x hidden) and a large one: seconds per all-reduce, algorithm bandwidth (bytes /
  time) and bus bandwidth (algbw x 2(n-1)/n, NCCL's tests' measure), and one decode step's
  all-reduce time for a 70B shape (2 per layer + the embedding, 80 layers, 256 tokens).
- pagedserve: greedy tokens of a random-weight Llama through the in-process engine with
  --tensor-parallel-size 2 on the GPUs against 1 rank. Where pagedserve refuses N > 1 on
  a GPU (per-GPU pools not built yet) the refusal is recorded and the part fails.
`ok` needs both. gpu_check.py calls `part_tp(args, part, work, build_model)`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

SIZES = {"decode step, 256 tokens x 8192 hidden": 256 * 8192, "prefill chunk, 2048 x 8192": 2048 * 8192,
         "256 MiB": 128 << 20}  # bfloat16 elements
STEP_SHAPE = dict(layers=80, hidden=8192, tokens=256)  # a 70B decode step: 2 all-reduces a layer + 1
WORLD = 2


def bus_bandwidth(seconds: float, nbytes: int, world: int = WORLD) -> dict:
    """NCCL tests' numbers for one all-reduce: algbw = bytes / time, busbw = algbw * 2(n-1)/n."""
    algbw = nbytes / seconds
    return {"seconds": seconds, "bytes": nbytes, "algbw_gb_s": algbw / 1e9,
            "busbw_gb_s": algbw * 2 * (world - 1) / world / 1e9}


def nccl_worker(rank: int, port: int, out: str) -> None:
    """One rank of the all-reduce measurement; rank 0 writes the results to `out`."""
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    results = {}
    for name, n in SIZES.items():
        x = torch.ones(n, dtype=torch.bfloat16, device="cuda")
        for _ in range(5):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        repeats = 20
        start = time.perf_counter()
        for _ in range(repeats):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        results[name] = bus_bandwidth((time.perf_counter() - start) / repeats, n * 2)
    check = torch.full((4,), float(rank + 1), device="cuda")
    dist.all_reduce(check)
    results["sum_correct"] = bool((check == 3).all())
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(results))


def run_nccl(work: Path, timeout: float, env: dict) -> dict:
    from pagedserve.rpc.ports import free_port

    port = free_port()
    out = work / "nccl.json"
    procs = [subprocess.Popen([sys.executable, __file__, "--nccl-worker", str(r), str(port), str(out)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(WORLD)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=max(1.0, timeout))[0])
        except subprocess.TimeoutExpired:
            p.kill()
            logs.append(p.communicate()[0])
    if not out.exists():
        return {"ok": False, "error": "\n".join(logs)[-1500:]}
    results = json.loads(out.read_text())
    step = results["decode step, 256 tokens x 8192 hidden"]["seconds"]
    results["decode_step_allreduce_s_70b"] = step * (2 * STEP_SHAPE["layers"] + 1)
    results["ok"] = results.pop("sum_correct")
    return results


def run_pagedserve(model_dir: Path) -> dict:
    """Greedy tokens with 2 ranks on cuda against 1 rank; a refusal is recorded as such."""
    from pagedserve.engine import LLMEngine
    from pagedserve.wire.protocol import SamplingParams

    prompts = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42, 5, 6]]
    sampling = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outs = {}
    for world in (1, WORLD):
        try:
            engine = LLMEngine(model=str(model_dir), device="cuda", dtype="float32", block_size=16,
                               kv_tokens=4096, tensor_parallel_size=world)
        except ValueError as e:
            return {"ran": False, "refused": str(e), "ranks": world}
        try:
            outs[world] = [o.completions[0].token_ids for o in engine.generate(prompts, sampling)]
        finally:
            engine.close()
    return {"ran": True, "greedy_equal": outs[1] == outs[WORLD], "tokens": outs}


def part_tp(args, part, work: Path, build_model) -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"status": "skipped", "reason": "no CUDA: the tensor-parallel part did not run"}
    gpus = torch.cuda.device_count()
    part.put("gpus", gpus)
    if gpus < WORLD:
        return {"status": "skipped",
                "reason": f"fewer than {WORLD} GPUs ({gpus} visible): the tensor-parallel part did not run"}
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent)
               + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""))
    nccl = part.put("nccl_all_reduce", run_nccl(work, part.left() * 0.6, env))
    model = build_model(work / "tp-llama", hidden=256, layers=2, heads=8, kv_heads=2, inter=512)
    tp = part.put("pagedserve_tp2", run_pagedserve(model))
    if not tp["ran"]:
        return {"status": "failed", "reason": f"pagedserve refused 2 ranks on the GPUs: {tp['refused']}"}
    ok = nccl.get("ok") and tp["greedy_equal"]
    return {"status": "ok" if ok else "failed"}


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--nccl-worker":
        nccl_worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    else:
        sys.exit("usage: gpu_check_tp.py --nccl-worker RANK PORT OUT (gpu_check.py runs the tp part)")
