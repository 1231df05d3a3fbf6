"""gpu_check's `steady` part (issue 42, "Measured at steady state, beside a peer"): for each
named shape, a random-weight Llama drawn on the device, served through the split services
(memsvc, an executor whose steps are timed: gpu_check_steady_hook.py, the gateway with
--max-num-seqs 256) to N ShareGPT-like requests at rate inf (pagedserve.benchmarks'
generator, seed 0, prompts as `bench serve` draws them), then transformers' continuous
batching on the same model object and requests (gpu_check_steady_peer.py).

Per shape: output tok/s, TTFT and TPOT of both; the device's busy share (torch profiler over
a window of steady steps) and the share of wall time inside steps (CUDA events); each
decode-only step's time against its memory roofline (gpu_check_steady_report.py), over the
device copy bandwidth measured first. Each shape has a share of the part's seconds; serving
and the peer each get a cap within it and a cut run reports what it finished (marked CUT).

Shapes (bf16): 1.1B (hidden 2048, 16 layers, 32/8 heads of 64, MLP 8192, vocab 32k) and 8B
(Llama-3-8B: 4096, 32 layers, 32/8 heads of 128, MLP 14336, vocab 128256), saved to /dev/shm
when it has room (the disk otherwise) and removed after. --rehearse: two tiny shapes, 20
requests of at most 256 tokens, on the CPU in float32 (the profiler times operators there).

  python scripts/gpu_check_steady.py [--rehearse] [--shapes 1.1B,8B] [--num-requests 1000]
                                     [--budget SECONDS] [--out FILE]
gpu_check.py runs it as the part `steady` (part_steady), beside its other parts.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check_common import ROOT  # noqa: E402
from gpu_check_steady_report import model_bytes, one_line, step_figures  # noqa: E402

SHAPES = {
    "1.1B": dict(hidden=2048, layers=16, heads=32, kv_heads=8, inter=8192, vocab=32000),
    "8B": dict(hidden=4096, layers=32, heads=32, kv_heads=8, inter=14336, vocab=128256),
    "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, inter=128, vocab=32000),
    "tiny2": dict(hidden=96, layers=3, heads=6, kv_heads=2, inter=192, vocab=32000),
}
SHARE = {"1.1B": 0.35, "8B": 0.65}  # of the part's seconds; others share equally
PROMPT_VOCAB = 32000  # prompt ids drawn in [100, 32000) for every shape: the same requests
MAX_NUM_SEQS = 256
KV_GIB = 40  # at most; less where the device's free memory after two copies of the weights is short
SERVE_SHARE = 0.6  # of a shape's seconds left once its services serve; the peer gets the rest
HOOK = Path(__file__).resolve().parent / "gpu_check_steady_hook.py"


def copy_gb_per_s(torch, device) -> float:
    if str(device).startswith("cuda"):
        from gpu_check_attention import copy_gb_per_s as on_gpu

        return on_gpu(torch, device)
    src = torch.empty(1 << 26, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t0 = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    return 2 * src.numel() * 10 / (time.perf_counter() - t0) / 1e9


def model_home(nbytes: int, work: Path) -> Path:
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > 1.5 * nbytes + (1 << 30):
        return Path(shm)
    return work


def wait_for_dump(out: Path, timeout: float) -> dict:
    out.unlink(missing_ok=True)
    trigger = Path(f"{out}.dump")
    trigger.touch()
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if out.exists() and not trigger.exists():
            return json.loads(out.read_text())
        time.sleep(0.2)
    return {"error": f"the executor's hook wrote no {out.name} in {timeout:.0f} s"}


def serve(svc, reqs, time_limit: float) -> dict:
    from pagedserve.benchmarks.serve import run_load
    from pagedserve.benchmarks.serve_metrics import summarize

    gateway = f"127.0.0.1:{svc.ports['gateway']}"
    timings, duration = asyncio.run(run_load(gateway, reqs, seed=0, vocab=PROMPT_VOCAB, progress=False,
                                             time_limit=time_limit))
    out = summarize(timings, duration)
    received = sum(t.output_tokens for t in timings)
    out.update(cut=any(t.status == "CUT" for t in timings), output_tokens_received=received,
               output_tokens_expected=sum(r.output_len for r in reqs),
               output_token_throughput_received=received / duration if duration else 0.0)
    return out


def run_shape(name: str, opts, work: Path, deadline: float, result: dict, put) -> None:
    """One shape, start to end, into `result`; `put()` records it as it grows (a cut or an
    error leaves what was done)."""
    import torch

    from gpu_check_models import Services, random_llama, save_model
    from gpu_check_steady_peer import transformers_cb
    from pagedserve.benchmarks.serve import prompt_token_ids
    from pagedserve.benchmarks.workloads import poisson_arrivals, sample_lengths

    g = SHAPES[name]
    result.update(shape=g, num_requests=opts.num_requests, dtype=opts.dtype, max_num_seqs=MAX_NUM_SEQS)
    put()
    left = lambda: deadline - time.monotonic()  # noqa: E731
    t0 = time.monotonic()
    dtype = getattr(torch, opts.dtype)
    model = random_llama(hidden=g["hidden"], layers=g["layers"], heads=g["heads"], kv_heads=g["kv_heads"],
                         inter=g["inter"], vocab=g["vocab"], max_pos=4096, std=0.02, device=opts.device, dtype=dtype)
    sizes = model_bytes([(n, p.numel()) for n, p in model.named_parameters()], dtype.itemsize, g["layers"],
                        g["kv_heads"], g["hidden"] // g["heads"])
    total = sum(p.numel() for p in model.parameters()) * dtype.itemsize
    model_dir = model_home(total, work) / f"steady-{name}-{os.getpid()}"
    save_model(model, model_dir)
    result.update(sizes, parameters=total // dtype.itemsize, model_dir=str(model_dir), build_s=time.monotonic() - t0)
    put()
    reqs = sample_lengths("sharegpt", opts.num_requests, seed=0, max_total=opts.max_total)
    poisson_arrivals(reqs, math.inf)
    prompts = prompt_token_ids(reqs, seed=0, vocab=PROMPT_VOCAB)
    kv = 1
    if opts.device.startswith("cuda"):
        free = torch.cuda.mem_get_info()[0]
        kv = max(1, min(KV_GIB, int((free - total - (8 << 30)) / (1 << 30))))
    hook_out = work / f"hook-{name}.json"
    os.environ.update(STEADY_HOOK_OUT=str(hook_out), STEADY_HOOK_PROFILE_AT=str(opts.profile_at),
                      STEADY_HOOK_PROFILE_STEPS=str(opts.profile_steps))
    try:
        t1 = time.monotonic()
        svc = Services(model_dir, opts.device, opts.dtype, extra_memsvc=["--kv-memory", str(kv)],
                       extra_gateway=["--max-num-seqs", str(MAX_NUM_SEQS)], log_dir=opts.logs / f"steady-{name}",
                       executor_cmd=[sys.executable, str(HOOK)]).start(timeout=max(1.0, min(300.0, left())))
        result.update(kv_gib=kv, services_start_s=time.monotonic() - t1)
        try:
            warm = sample_lengths("random", 8, input_len=32, output_len=8)
            poisson_arrivals(warm, math.inf)
            result["warmup"] = {k: v for k, v in serve(svc, warm, max(1.0, min(60.0, left()))).items()
                                if k in ("completed", "errors", "duration_s")}
            Path(f"{hook_out}.go").touch()
            cap = max(1.0, (left() - 15) * SERVE_SHARE)
            result["serve_cap_s"] = cap
            start = time.time()
            result["pagedserve"] = serve(svc, reqs, cap)
            end = time.time()
            put()
            hook = wait_for_dump(hook_out, 60)
            result["steps"] = step_figures(hook, start, end, sizes, opts.copy_gb_per_s)
        finally:
            svc.stop()
            result["executor_log_tail"] = svc.tail("executor", 600)
        put()
        cap = left() - 10
        if cap < 5:
            result["transformers_cb"] = {"skipped": "time budget"}
        else:
            if opts.device.startswith("cuda"):
                torch.cuda.empty_cache()
            result["transformers_cb"] = transformers_cb(model, prompts, [r.output_len for r in reqs], cap)
            ps, peer = result["pagedserve"], result["transformers_cb"]
            if peer["output_token_throughput"] > 0:
                result["vs_transformers"] = ps["output_token_throughput_received"] / peer["output_token_throughput"]
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)
        del model
        if opts.device.startswith("cuda"):
            torch.cuda.empty_cache()
    result["seconds"] = time.monotonic() - t0


def run(opts, work: Path, budget: float, put) -> dict:
    """Every shape in opts.shapes within `budget` seconds; `put(key, value)` records a step."""
    import torch

    start = time.monotonic()
    opts.copy_gb_per_s = put("copy_gb_per_s", copy_gb_per_s(torch, opts.device))
    shares = [SHARE.get(s, 1 / len(opts.shapes)) for s in opts.shapes]
    shapes, ok = {}, True
    for i, name in enumerate(opts.shapes):
        left = budget - (time.monotonic() - start)
        mine = left * shares[i] / sum(shares[i:])
        shapes[name] = {}
        try:
            run_shape(name, opts, work, time.monotonic() + mine, shapes[name], lambda: put("shapes", shapes))
        except Exception as e:  # noqa: BLE001 - recorded; the next shape still runs
            import traceback

            shapes[name].update(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-3000:])
        put("shapes", shapes)
        ps = shapes[name].get("pagedserve") or {}
        ok = ok and "error" not in shapes[name] and ps.get("completed", 0) > 0 and not ps.get("errors")
        print(one_line(name, shapes[name]), flush=True)
    return {"status": "ok" if ok else "failed"}


def options(rehearse: bool, device: str, logs: Path, shapes=None, num_requests=None) -> argparse.Namespace:
    """The settings of a run: on a GPU the issue's, rehearsing the tiny ones on the CPU."""
    return argparse.Namespace(
        shapes=shapes or (["tiny", "tiny2"] if rehearse else ["1.1B", "8B"]),
        num_requests=num_requests or (20 if rehearse else 1000), max_total=256 if rehearse else 2048,
        device="cpu" if rehearse else device, dtype="float32" if rehearse else "bfloat16",
        profile_at=5 if rehearse else 200, profile_steps=10 if rehearse else 50, logs=logs)


def part_steady(args, part, work: Path) -> dict:
    """gpu_check.py's part: on a GPU the issue's shapes; without one, the rehearsal."""
    rehearse = not str(args.device).startswith("cuda")
    opts = options(rehearse, args.device, args.logs, num_requests=32 if args.quick else None)
    part.put("settings", {k: v for k, v in vars(opts).items() if k != "logs"})
    return run(opts, work, max(1.0, part.left()), part.put)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rehearse", action="store_true", help="tiny shapes, 20 requests, on the CPU")
    p.add_argument("--shapes", default=None, help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--budget", type=float, default=360, help="seconds for every shape together")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=str(Path(os.environ.get("OUT", ROOT / "bench_results")) / "gpu_steady.json"))
    a = p.parse_args(argv)
    shapes = a.shapes.split(",") if a.shapes else None
    if shapes and set(shapes) - set(SHAPES):
        p.error(f"--shapes: unknown {', '.join(sorted(set(shapes) - set(SHAPES)))}; choose of {', '.join(SHAPES)}")
    sys.path.insert(0, str(ROOT))
    logs = Path(a.out).with_name(Path(a.out).stem + "-logs")
    opts = options(a.rehearse, a.device, logs, shapes, a.num_requests)
    report = {"schema": "pagedserve.gpu_steady/1", "settings": {k: v for k, v in vars(opts).items() if k != "logs"},
              "started": time.strftime("%Y-%m-%dT%H:%M:%S")}

    def put(key, value):
        report[key] = value
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(report, indent=1, default=str))
        return value

    import tempfile

    report.update(run(opts, Path(tempfile.mkdtemp(prefix="gpu_steady-")), a.budget, put))
    put("status", report["status"])
    return 0 if report["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
