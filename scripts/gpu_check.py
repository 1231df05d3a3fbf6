"""One GPU check of pagedserve, written to one JSON file (see scripts/gpu_check.sh).

First the environment (versions; grpcio and protobuf at the floors the stubs need), then the
parts, most decisive first (each bounded in time, each recorded even when it fails; the file
is rewritten as each part's steps end, so a cut still leaves what finished; service logs go
next to it):
  services   memsvc, executor and gateway as separate processes sharing the pool through
             CUDA IPC: float32 greedy vs transformers' generate token for token (random-weight
             Llama), n=4 and beam 4 likewise, SIGKILL of the executor mid-run; bfloat16 end to
             end against transformers with eager attention (BF16_TOLERANCE); swap under a
             tiny pool
  kernels    store_kv, copy_blocks and swap exactly, the fused per-layer ops (norms, SiLU-and-
             multiply, rotary in the K/V store) against their references and the model's torch
             code (scripts/gpu_check_fused.py), then paged attention against a float32
             reference at the shapes that matter (KERNEL_CASES: the models served, decode,
             split context, prefill chunks beside decodes, bf16/fp16/fp32), and that batches
             of other sizes compile nothing new
  bench      decode kernel bandwidth vs the D2D copy bandwidth measured in the same run (batch
             256 x context 2k, bf16), paged vs dense attention on the same data
  tp         only with 2 or more GPUs (else "skipped", saying it did not run): NCCL
             all-reduce bandwidth between 2 GPUs and pagedserve's greedy tokens with
             --tensor-parallel-size 2 against 1 rank (scripts/gpu_check_tp.py); when it does
             not run, its budget goes to serve
  serve      `pagedserve serve` throughput (random-weight 1B Llama shape, ShareGPT-like
             lengths, rates 4/16/inf) vs transformers static batching
  split      what the split services cost per step beside the in-process engine on that
             model: a batch and one stream (scripts/gpu_check_split.py; not with --quick)
  steady     only when named in --parts (it takes ~6 minutes): 1,000 ShareGPT-like requests at
             rate inf to the 1.1B and 8B shapes through the services, the device's busy share
             and the decode step against its roofline, beside transformers' continuous batching
             on the same model and requests (scripts/gpu_check_steady.py); without CUDA, its
             rehearsal (two tiny shapes, 20 requests, on the CPU)

Greedy comparisons let EOS end a sequence on both sides: transformers' min_new_tokens masks
EOS while pagedserve's ignore_eos does not, so the two would differ wherever EOS is the top
token. Without CUDA (the rehearsal, `gpu_check.sh --rehearse`) the services run on the CPU
over shared memory, kernels/bench/serve are "skipped: no CUDA" after checking their imports
and the arguments of the commands they would run.

No network and no model download: models are random-weight Llama configs saved with a
tokenizer built in place (tokenizers' WordLevel over a made-up vocabulary).
`--dry-run` checks arguments and writes the JSON skeleton without torch or a GPU.

This file runs the parts and writes the report; each part is a module beside it, imported
only when the parts run: gpu_check_services.py, gpu_check_kernels.py (KERNEL_CASES),
gpu_check_bench.py, gpu_check_tp.py, gpu_check_serve.py and gpu_check_split.py, over
gpu_check_models.py (the models, transformers' references with BF16_TOLERANCE, the services'
processes), gpu_check_attention.py (paged-attention data, its reference and REL_TOL, timing) and
gpu_check_common.py (ROOT, child_env).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

SCHEMA = "pagedserve.gpu_check/1"
PARTS = ["services", "kernels", "bench", "tp", "serve", "split", "steady"]  # the most decisive first
DEFAULT_PARTS = PARTS[:-1]  # steady runs only when named: its ~6 minutes do not fit beside the rest
ROOT = Path(__file__).resolve().parent.parent
# Seconds per part on one H200. The full run ends under 8 minutes and --quick under 4, start-up
# included: gpu_check.sh's wheel check, torch's import and CUDA's start take ~15 s, and the
# outer cut (GPU_CHECK_TIMEOUT in gpu_check.sh) is 470 s full, 235 s quick.
#   services: three service starts (~10 s each once Triton's cache holds the kernels; the first
#             compiles ~5 variants), transformers' references, ~1500 tokens generated
#   kernels:  ~1 s a case plus ~3-8 s for each new compiled variant (8 quick cases share ~6)
#   bench:    the copy bandwidth, then 2 (quick) or 5 shapes, 20 timed launches each
#   tp:       2 NCCL processes (~10 s to start), a tiny model on 1 and 2 ranks; with fewer than
#             2 GPUs it does not run and serve gets its seconds
#   serve:    a 1B model built on the GPU, its services, the rates, transformers' batches
#   split:    bench split twice on that model (its services and an in-process engine each time)
# Measured on the first H200 run (2026-12-04, warm Triton cache but the first): services 84 s,
# kernels 6-13 s, bench 1-3 s, serve 74 s quick / 141 s full; --quick 172 s in all.
#   steady:   per shape (1.1B 35%, 8B 65%): the model drawn and saved, the services, 1,000
#             requests (at most 60% of what is left then), transformers' continuous batching
#             (the rest); not measured yet on a GPU
DEFAULT_BUDGETS = {"services": 120, "kernels": 60, "bench": 30, "tp": 25, "serve": 130, "split": 90,
                   "steady": 340}  # 455 s without steady
QUICK_BUDGETS = {"services": 100, "kernels": 45, "bench": 15, "tp": 10, "serve": 40, "split": 0,
                 "steady": 200}  # 210 s without steady (with --quick, steady sends 32 requests)
CUDA_PARTS = ("kernels", "bench", "tp", "serve", "split")  # skipped without CUDA (services run on the CPU)
STATUSES = ("pending", "running", "skipped", "ok", "failed", "error")


def default_out() -> str:
    """$OUT/gpu_check.json where $OUT is set (the device machine returns what is written
    there), else bench_results/gpu_check.json."""
    base = os.environ.get("OUT")
    return str(Path(base) / "gpu_check.json") if base else "bench_results/gpu_check.json"


class Cut(BaseException):
    """SIGTERM (the outer `timeout`): ends the running part, whose services stop, and the
    report is written before the process exits."""


def on_sigterm(signum, frame):
    raise Cut("SIGTERM: the outer time limit cut the run")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=default_out(), help="the JSON file to write (default: $OUT/gpu_check.json "
                   "when $OUT is set, else bench_results/gpu_check.json); service logs go to OUT-logs/")
    p.add_argument("--parts", default=",".join(DEFAULT_PARTS),
                   help=f"comma-separated, of {', '.join(PARTS)} (default: all but steady)")
    p.add_argument("--device", default="cuda", help="cuda or cuda:N")
    p.add_argument("--quick", action="store_true", help="fewer shapes and requests (a smoke run)")
    p.add_argument("--dry-run", action="store_true", help="check arguments, write the skeleton, run nothing")
    p.add_argument("--aot-compile", action="store_true", help="without CUDA: compile the Triton kernels for "
                   "sm_90 ahead of time (pagedserve.kernels.triton_aot; ~30 s; the rehearsal does)")
    p.add_argument("--budget", action="append", default=[], metavar="PART=SECONDS",
                   help="time budget of a part (default: " + ", ".join(f"{k}={v}" for k, v in DEFAULT_BUDGETS.items())
                   + "; with --quick " + ", ".join(f"{k}={v}" for k, v in QUICK_BUDGETS.items()) + ")")
    args = p.parse_args(argv)
    args.parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    unknown = [x for x in args.parts if x not in PARTS]
    if unknown:
        p.error(f"unknown parts: {', '.join(unknown)}")
    budgets = dict(QUICK_BUDGETS if args.quick else DEFAULT_BUDGETS)
    for item in args.budget:
        name, _, seconds = item.partition("=")
        if name not in PARTS or not seconds:
            p.error(f"--budget {item}: expected PART=SECONDS")
        budgets[name] = float(seconds)
    args.budgets = budgets
    args.logs = Path(args.out).with_name(Path(args.out).stem + "-logs")
    return args


def skeleton(args) -> dict:
    return {
        "schema": SCHEMA, "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "dry_run": bool(args.dry_run),
        "env": {"python": platform.python_version(), "host": platform.node()},
        "parts": {name: {"status": "pending"} if name in args.parts else {"status": "skipped", "reason": "not in --parts"}
                  for name in PARTS},
        "elapsed_s": 0.0,
    }


def validate(report: dict) -> list[str]:
    """What is wrong with a report's shape (empty: nothing)."""
    problems = []
    if report.get("schema") != SCHEMA:
        problems.append("schema")
    parts = report.get("parts", {})
    for name in PARTS:
        part = parts.get(name)
        if not isinstance(part, dict) or part.get("status") not in STATUSES:
            problems.append(f"parts.{name}.status")
    return problems


class Part:
    """A running part's result: `put` records one step's outcome and rewrites the JSON file at
    once; `over()` tells whether the part's deadline has passed, `left()` the seconds to it."""

    def __init__(self, report: dict, name: str, deadline: float, save):
        self.result = report["parts"][name] = {"status": "running"}
        self.deadline, self.save = deadline, save

    def put(self, key, value):
        self.result[key] = value
        self.save()
        return value

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def over(self) -> bool:
        return self.left() <= 0


def write(report: dict, path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=2, default=str)
    os.replace(tmp, path)


def skipped_without_cuda(args, part: Part):
    return {"status": "skipped", "reason": "no CUDA"}


# ---------------------------------------------------------------- main

def environment(args) -> dict:
    """Versions, the GPU, and what is wrong with them (`problems`: grpcio or protobuf below the
    floors the stubs need). Without CUDA, args.device becomes "cpu" (the rehearsal)."""
    import torch

    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_packages

    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for name in ("triton", "transformers", "grpc", "google.protobuf"):
        try:
            env[name] = __import__(name, fromlist=["__version__"]).__version__
        except Exception as e:  # noqa: BLE001
            env[name] = f"missing: {e}"
    env["problems"] = gpu_packages.problems()
    env["cuda_available"] = torch.cuda.is_available()
    if env["cuda_available"]:
        env["gpu"] = torch.cuda.get_device_name(args.device)
        env["gpu_memory_gib"] = torch.cuda.get_device_properties(args.device).total_memory / 2**30
    else:
        args.device = "cpu"
        image = gpu_packages.image_packages()
        env["note"] = (f"no CUDA: services on the CPU, {', '.join(CUDA_PARTS)} skipped; torch {torch.__version__} "
                       f"here, the GPU machine's image has torch {image['torch'][0]}, Triton {image['triton'][0]}, "
                       f"transformers {image['transformers'][0]} (scripts/gpu_image_packages.txt)")
    return env


def runners(args, work: Path) -> dict:
    """Each part's function of its Part; without CUDA, the stand-ins of the CUDA parts."""
    if str(ROOT / "scripts") not in sys.path:
        sys.path.insert(0, str(ROOT / "scripts"))
    from gpu_check_bench import part_bench
    from gpu_check_kernels import kernels_without_cuda, part_kernels
    from gpu_check_models import build_model
    from gpu_check_serve import part_serve, serve_without_cuda
    from gpu_check_services import part_services
    from gpu_check_split import part_split
    from gpu_check_steady import part_steady
    from gpu_check_tp import part_tp

    tp = lambda p: part_tp(args, p, work, build_model)  # noqa: E731  (says itself when it does not run)
    split = lambda p: (part_split(args, p, work, build_model) if not args.quick  # noqa: E731
                       else {"status": "skipped", "reason": "not run: --quick"})
    steady = lambda p: part_steady(args, p, work)  # noqa: E731  (without CUDA: its rehearsal)
    if str(args.device).startswith("cuda"):
        return {"kernels": lambda p: part_kernels(args, p), "services": lambda p: part_services(args, p, work),
                "bench": lambda p: part_bench(args, p), "serve": lambda p: part_serve(args, p, work), "tp": tp,
                "split": split, "steady": steady}
    return {"kernels": lambda p: kernels_without_cuda(args, p), "services": lambda p: part_services(args, p, work),
            "bench": lambda p: skipped_without_cuda(args, p), "serve": lambda p: serve_without_cuda(args, p, work),
            "tp": tp, "split": split, "steady": steady}


def main(argv=None) -> int:
    args = parse_args(argv)
    report = skeleton(args)
    if args.dry_run:
        write(report, args.out)
        print(json.dumps({"out": args.out, "parts": args.parts, "budgets": args.budgets}))
        return 0
    sys.path.insert(0, str(ROOT))
    start = time.monotonic()
    report["env"].update(environment(args))
    report["budgets"] = args.budgets
    write(report, args.out)
    for line in report["env"].get("problems", []) + ([report["env"]["note"]] if "note" in report["env"] else []):
        print(f"gpu_check: {line}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="gpu_check-"))
    report["work_dir"] = str(work)
    report["logs"] = str(args.logs)
    signal.signal(signal.SIGTERM, on_sigterm)
    run = runners(args, work)
    for name in args.parts:
        t0 = time.monotonic()
        budget = args.budgets[name]
        if name == "serve" and report["parts"]["tp"]["status"] == "skipped" and "tp" in args.parts:
            budget += args.budgets["tp"]  # tp did not run (fewer than 2 GPUs): serve gets its seconds
        part = Part(report, name, t0 + budget, lambda: write(report, args.out))
        cut = None
        try:
            part.result.update(run[name](part))
        except Cut as e:
            cut = e
            part.result.update(status="error", error=str(e))
        except Exception as e:  # noqa: BLE001 - every part is recorded, the next still runs
            part.result.update(status="error", error=f"{type(e).__name__}: {e}",
                               traceback=traceback.format_exc()[-4000:])
        part.result["seconds"] = time.monotonic() - t0
        report["elapsed_s"] = time.monotonic() - start
        write(report, args.out)
        status = part.result["status"]
        why = f": {part.result['reason']}" if status == "skipped" and "reason" in part.result else ""
        print(f"{name}: {status}{why} in {part.result['seconds']:.0f}s", flush=True)
        if cut is not None:
            break
    # a part skipped for want of CUDA is not a failure (the rehearsal); any other state is
    bad = [n for n in args.parts if report["parts"][n]["status"] not in ("ok", "skipped")]
    return 1 if bad or report["env"].get("problems") else 0


if __name__ == "__main__":
    sys.exit(main())
