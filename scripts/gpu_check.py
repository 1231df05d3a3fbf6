"""One GPU check of pagedserve, written to one JSON file (see scripts/gpu_check.sh).

Parts (each bounded in time, each recorded even when it fails; the file is rewritten after
every part, so a timeout still leaves what finished):
  kernels    every Triton kernel vs its torch reference at real shapes (head 64/128, GQA
             1/4/8, block 16/32, contexts to 8k, bf16/fp16/fp32), split-context included
  services   memsvc, executor and gateway as separate processes sharing the pool through
             CUDA IPC: greedy output vs transformers' generate on the GPU (random-weight
             Llama), n=4, beam 4, swap under a tiny pool, SIGKILL of the executor mid-run
  bench      decode kernel bandwidth vs the D2D copy bandwidth measured in the same run (batch
             256 x context 2k, bf16), paged vs dense attention on the same data
  serve      `pagedserve serve` throughput (random-weight 1B Llama shape, ShareGPT-like
             lengths, rates 4/16/inf) vs transformers static batching; control-plane share

No network and no model download: models are random-weight Llama configs saved with a
tokenizer built in place (tokenizers' WordLevel over a made-up vocabulary).
`--dry-run` checks arguments and writes the JSON skeleton without torch or a GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

SCHEMA = "pagedserve.gpu_check/1"
PARTS = ["kernels", "services", "bench", "serve"]
ROOT = Path(__file__).resolve().parent.parent
DEFAULT_BUDGETS = {"kernels": 90, "services": 150, "bench": 60, "serve": 150}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench_results/gpu_check.json", help="the JSON file to write")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    p.add_argument("--device", default="cuda", help="cuda or cuda:N")
    p.add_argument("--quick", action="store_true", help="fewer shapes and requests (a smoke run)")
    p.add_argument("--dry-run", action="store_true", help="check arguments, write the skeleton, run nothing")
    p.add_argument("--budget", action="append", default=[], metavar="PART=SECONDS",
                   help="time budget of a part (default: " + ", ".join(f"{k}={v}" for k, v in DEFAULT_BUDGETS.items()) + ")")
    args = p.parse_args(argv)
    args.parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    unknown = [x for x in args.parts if x not in PARTS]
    if unknown:
        p.error(f"unknown parts: {', '.join(unknown)}")
    budgets = dict(DEFAULT_BUDGETS)
    for item in args.budget:
        name, _, seconds = item.partition("=")
        if name not in PARTS or not seconds:
            p.error(f"--budget {item}: expected PART=SECONDS")
        budgets[name] = float(seconds)
    args.budgets = budgets
    return args


def skeleton(args) -> dict:
    return {
        "schema": SCHEMA, "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "dry_run": bool(args.dry_run),
        "env": {"python": platform.python_version(), "host": platform.node()},
        "parts": {name: {"status": "skipped" if name not in args.parts else "pending"} for name in PARTS},
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
        if not isinstance(part, dict) or part.get("status") not in ("pending", "skipped", "ok", "failed", "error"):
            problems.append(f"parts.{name}.status")
    return problems


def write(report: dict, path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=2, default=str)
    os.replace(tmp, path)


# ---------------------------------------------------------------- shared helpers (torch)

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_paged(torch, num_seqs, context, q_len, num_heads, num_kv, head, block, dtype, device, seed=0):
    """A random pool with each sequence's blocks shuffled, and the kernel arguments."""
    gen = torch.Generator(device=device).manual_seed(seed)
    per_seq = -(-context // block)
    num_blocks = num_seqs * per_seq + 1
    pool = torch.randn((num_blocks, 2, block, num_kv, head), generator=gen, device=device).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen, device=device)[: num_seqs * per_seq]
    tables = tables.view(num_seqs, per_seq).to(torch.int32)
    q = torch.randn((num_seqs * q_len, num_heads, head), generator=gen, device=device).to(dtype)
    return dict(q=q, k_cache=pool[:, 0], v_cache=pool[:, 1], block_tables=tables,
                seq_lens=torch.full((num_seqs,), context, dtype=torch.int32, device=device),
                query_start_loc=torch.arange(0, num_seqs * q_len + 1, q_len, dtype=torch.int32, device=device))


def timed(torch, fn, repeats=20):
    fn()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


# ---------------------------------------------------------------- part 1: kernels

def part_kernels(args, deadline):
    import torch

    from kernels.copy_blocks_ref import copy_blocks_ref
    from kernels.copy_blocks_triton import copy_blocks_triton
    from kernels.paged_attention_ref import paged_attention_ref
    from kernels.paged_attention_triton import paged_attention_triton
    from kernels.store_kv_ref import store_kv_ref
    from kernels.store_kv_triton import store_kv_triton

    device = args.device
    tol = {torch.float32: 2e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}
    dtypes = [torch.bfloat16, torch.float16, torch.float32]
    contexts = [(8, 1), (4, 3000), (1, 8192)] if args.quick else [(64, 1), (64, 300), (8, 2048), (2, 8192), (1, 5000)]
    cases, failures = [], 0
    for dtype in dtypes:
        for head in (64, 128):
            for gqa in (1, 4, 8):
                for block in (16, 32):
                    for num_seqs, context in contexts:
                        if time.monotonic() > deadline:
                            return {"status": "failed", "reason": "time budget", "cases": cases}
                        num_kv = 2 if gqa > 1 else 8
                        for q_len, splits in ((1, None), (1, 4), (min(context, 128), None)):
                            if q_len > 1 and num_seqs > 8:
                                continue
                            a = make_paged(torch, num_seqs, context, q_len, num_kv * gqa, num_kv, head, block,
                                           dtype, device)
                            ref = paged_attention_ref(**a, scale=head ** -0.5)
                            out = paged_attention_triton(**a, scale=head ** -0.5, num_splits=splits)
                            err = (out.float() - ref.float()).abs().max().item()
                            ok = err <= tol[dtype] * max(1.0, ref.float().abs().max().item())
                            failures += not ok
                            cases.append(dict(kernel="paged_attention", dtype=str(dtype)[6:], head=head, gqa=gqa,
                                              block=block, seqs=num_seqs, context=context, q_len=q_len,
                                              splits=splits or "auto", max_abs_err=err, ok=ok))
    for dtype in dtypes:  # store_kv and copy_blocks: exact
        pool = torch.randn((64, 4, 2, 16, 8, 128), device=device).to(dtype)
        expect = pool.clone()
        slots = torch.randperm(64 * 16, device=device)[:300]
        slots[::7] = -1
        key = torch.randn((300, 8, 128), device=device).to(dtype)
        value = torch.randn((300, 8, 128), device=device).to(dtype)
        store_kv_triton(key, value, pool[:, 2, 0], pool[:, 2, 1], slots)
        store_kv_ref(key, value, expect[:, 2, 0], expect[:, 2, 1], slots)
        ok = torch.equal(pool, expect)
        cases.append(dict(kernel="store_kv", dtype=str(dtype)[6:], ok=ok))
        failures += not ok
        src, dst = torch.arange(0, 20, device=device), torch.arange(40, 60, device=device)
        copy_blocks_triton(pool, pool, src, dst)
        copy_blocks_ref(expect, expect, src, dst)
        ok = torch.equal(pool, expect)
        cases.append(dict(kernel="copy_blocks", dtype=str(dtype)[6:], ok=ok))
        failures += not ok
    from memsvc.host_pool import swap_copy, finish_copies  # swap through pinned memory, both ways

    pool = torch.randn((32, 2, 2, 16, 4, 64), device=device)
    host = torch.empty((16, 2, 2, 16, 4, 64), pin_memory=True)
    swap_copy(pool, host, [3, 9, 4, 5], [0, 1, 2, 7])
    back = torch.zeros_like(pool)
    swap_copy(host, back, [0, 1, 2, 7], [3, 9, 4, 5])
    finish_copies(back)
    ok = all(torch.equal(back[i], pool[i]) for i in (3, 9, 4, 5))
    cases.append(dict(kernel="swap_copy", ok=ok))
    failures += not ok
    return {"status": "ok" if failures == 0 else "failed", "num_cases": len(cases), "failures": failures,
            "cases": cases}


# ---------------------------------------------------------------- models without a download

def build_model(path: Path, *, hidden, layers, heads, kv_heads, inter, vocab=4096, max_pos=4096, std=0.1,
                seed=0) -> Path:
    """A random-weight Llama saved with a made-up WordLevel tokenizer (no network)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, intermediate_size=inter, vocab_size=vocab,
                         max_position_embeddings=max_pos, initializer_range=std, bos_token_id=1,
                         eos_token_id=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(vocab - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)
    return path


def hf_greedy(model_dir, prompts, max_new, dtype, device):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids], device=device)
            y = model.generate(x, max_new_tokens=max_new, do_sample=False, min_new_tokens=max_new,
                               pad_token_id=0)
            outs.append(y[0, len(ids):].tolist())
    del model
    torch.cuda.empty_cache()
    return outs


class Services:
    """memsvc, executor and gateway as three processes on loopback (the executor killable)."""

    def __init__(self, model_dir, device, dtype, extra_memsvc=(), log_dir=None):
        self.ports = {n: free_port() for n in ("memsvc", "executor", "gateway")}
        self.model_dir, self.device, self.dtype = str(model_dir), device, dtype
        self.extra_memsvc = list(extra_memsvc)
        self.log_dir = Path(log_dir or tempfile.mkdtemp())
        self.procs = {}

    def _start(self, name, argv):
        log = open(self.log_dir / f"{name}.log", "ab")
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.procs[name] = subprocess.Popen([sys.executable, "-m", "pagedserve.cli", *argv], cwd=ROOT, env=env,
                                            stdout=log, stderr=subprocess.STDOUT)

    def start_executor(self):
        p = self.ports
        self._start("executor", ["executor", "--port", str(p["executor"]), "--memsvc", f"127.0.0.1:{p['memsvc']}",
                                 "--model", self.model_dir, "--device", self.device, "--dtype", self.dtype])

    def start(self, timeout=120):
        from pagedserve.client import GenerationClient

        p = self.ports
        self._start("memsvc", ["memsvc", "--port", str(p["memsvc"]), *self.extra_memsvc])
        self.start_executor()
        self._start("gateway", ["gateway", "--port", str(p["gateway"]), "--executor",
                                f"127.0.0.1:{p['executor']}", "--memsvc", f"127.0.0.1:{p['memsvc']}"])
        self.client = GenerationClient(f"127.0.0.1:{p['gateway']}", timeout=120)
        end = time.monotonic() + timeout
        while not self.client.serving():
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited: {self.tail(name)}")
            if time.monotonic() > end:
                raise TimeoutError("services not SERVING: " + self.tail("executor"))
            time.sleep(0.5)
        return self

    def tail(self, name, n=2000):
        try:
            return (self.log_dir / f"{name}.log").read_text()[-n:]
        except OSError:
            return ""

    def generate(self, ids, sampling):
        completions = {}
        for d in self.client.generate(ids, sampling):
            completions.setdefault(d.index, []).extend(d.token_ids)
        return [completions[i] for i in sorted(completions)]

    def stop(self):
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


# ---------------------------------------------------------------- part 2: split services

def part_services(args, deadline, work: Path):
    import threading

    import torch

    from wire.protocol import SamplingParams

    model_dir = build_model(work / "tiny-llama", hidden=512, layers=4, heads=8, kv_heads=2, inter=1024)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 4000, (n,), generator=gen).tolist() for n in (5, 17, 40, 100)]
    max_new = 24
    dtype = "float32"  # identity with transformers needs the same arithmetic's rounding
    expected = hf_greedy(model_dir, prompts, max_new, dtype, args.device)
    result = {"model": "random Llama 512x4 (GQA 4)", "dtype": dtype}
    greedy = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
    svc = Services(model_dir, args.device, dtype, log_dir=work / "logs-services").start()
    try:
        got = [svc.generate(ids, greedy)[0] for ids in prompts]
        result["greedy_equal"] = [g == e for g, e in zip(got, expected)]
        n4 = svc.generate(prompts[1], SamplingParams(max_tokens=16, temperature=0.8, n=4, seed=7, ignore_eos=True))
        result["n4"] = {"completions": len(n4), "lengths": [len(c) for c in n4]}
        beams = svc.generate(prompts[2], SamplingParams(max_tokens=12, beam_width=4, n=4, ignore_eos=True))
        result["beam4"] = {"completions": len(beams), "best_equals_greedy_prefix": bool(beams)
                           and beams[0][:1] == expected[2][:1]}
        # SIGKILL the executor mid-run: the gateway retries, the new executor maps the same pool
        outs, errors = {}, []

        def run(i):
            try:
                outs[i] = svc.generate(prompts[i], SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))[0]
            except Exception as e:  # noqa: BLE001 - recorded
                errors.append(repr(e))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        time.sleep(1.0)
        svc.procs["executor"].send_signal(signal.SIGKILL)
        svc.procs["executor"].wait()
        svc.start_executor()
        for t in threads:
            t.join(120)
        alone = [svc.generate(ids, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))[0]
                 for ids in prompts]
        result["sigkill_executor"] = {"errors": errors, "same_outputs": [outs.get(i) == alone[i]
                                                                          for i in range(len(prompts))]}
    finally:
        svc.stop()
    # swap out and back under a tiny pool
    tiny = Services(model_dir, args.device, dtype, log_dir=work / "logs-swap",
                    extra_memsvc=["--kv-tokens", "256", "--preemption-mode", "swap", "--swap-space", "1"]).start()
    try:
        outs = {}
        threads = [threading.Thread(target=lambda i=i: outs.__setitem__(i, tiny.generate(
            prompts[i], SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))[0])) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        alone = [tiny.generate(ids, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))[0]
                 for ids in prompts]
        result["swap_tiny_pool"] = {"same_outputs": [outs.get(i) == alone[i] for i in range(4)],
                                    "memsvc_log_tail": tiny.tail("memsvc", 600)}
    finally:
        tiny.stop()
    ok = (all(result["greedy_equal"]) and result["n4"]["completions"] == 4 and result["beam4"]["completions"] == 4
          and not result["sigkill_executor"]["errors"] and all(result["sigkill_executor"]["same_outputs"])
          and all(result["swap_tiny_pool"]["same_outputs"]))
    result["status"] = "ok" if ok else "failed"
    return result


# ---------------------------------------------------------------- part 3: kernel bandwidth

def part_bench(args, deadline):
    import torch
    import torch.nn.functional as F

    from kernels.paged_attention_triton import paged_attention_triton

    device = args.device
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = timed(torch, lambda: dst.copy_(src), 10)
    copy_gbs = 2 * src.numel() / seconds / 1e9  # read + write
    del src, dst
    rows = []
    shapes = [(256, 2048, 32, 8, 128, 16), (32, 8192, 32, 8, 128, 16), (4, 8192, 32, 8, 128, 16),
              (256, 2048, 32, 8, 128, 32), (64, 2048, 16, 16, 64, 16)]
    for num_seqs, context, heads, kv, head, block in shapes[:2] if args.quick else shapes:
        a = make_paged(torch, num_seqs, context, 1, heads, kv, head, block, torch.bfloat16, device)
        scale = head ** -0.5
        t_paged = timed(torch, lambda: paged_attention_triton(**a, scale=scale))
        kv_bytes = 2 * num_seqs * context * kv * head * 2
        # dense: the same K/V gathered into contiguous [B, kv, context, head], then SDPA
        ids = a["block_tables"].long()
        k = a["k_cache"][ids].reshape(num_seqs, context, kv, head).transpose(1, 2).contiguous()
        v = a["v_cache"][ids].reshape(num_seqs, context, kv, head).transpose(1, 2).contiguous()
        q = a["q"].view(num_seqs, heads, 1, head)
        t_dense = timed(torch, lambda: F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True))
        rows.append(dict(seqs=num_seqs, context=context, heads=heads, kv_heads=kv, head=head, block=block,
                         paged_ms=t_paged * 1e3, dense_sdpa_ms=t_dense * 1e3,
                         paged_gb_per_s=kv_bytes / t_paged / 1e9,
                         fraction_of_copy=kv_bytes / t_paged / 1e9 / copy_gbs,
                         paged_over_dense=t_paged / t_dense - 1))
        del a, k, v
        if time.monotonic() > deadline:
            break
    goal = next((r for r in rows if r["seqs"] == 256 and r["context"] == 2048 and r["block"] == 16), None)
    return {"status": "ok", "copy_gb_per_s": copy_gbs, "rows": rows,
            "goal_bandwidth_70pct": None if goal is None else goal["fraction_of_copy"] >= 0.7,
            "goal_overhead_10pct": None if goal is None else goal["paged_over_dense"] <= 0.10}


# ---------------------------------------------------------------- part 4: serve throughput

def sharegpt_like(n, seed=0, vocab=30000, max_total=2048):
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = min(int(rng.lognormvariate(5.0, 0.9)) + 4, 1024)
        o = min(int(rng.lognormvariate(5.0, 0.8)) + 4, max_total - p, 512)
        out.append(([rng.randrange(3, vocab) for _ in range(p)], max(o, 1)))
    return out


def part_serve(args, deadline, work: Path):
    import asyncio  # noqa: F401 - the load generator's

    import torch

    model_dir = build_model(work / "llama-1b", hidden=2048, layers=16, heads=32, kv_heads=8, inter=8192,
                            vocab=32000, max_pos=4096, std=0.02)
    n = 40 if args.quick else 150
    reqs = sharegpt_like(n)
    result = {"model": "random Llama 1B shape (2048x16, GQA 4, vocab 32k), bfloat16", "num_requests": n}
    svc = Services(model_dir, args.device, "bfloat16", log_dir=work / "logs-serve",
                   extra_memsvc=["--kv-memory", "40"]).start(timeout=240)
    try:
        rates = {}
        for rate in ("4", "16", "inf"):
            if time.monotonic() > deadline:
                break
            out = work / f"serve-{rate}.json"
            cmd = [sys.executable, "-m", "pagedserve.cli", "bench", "serve", "--server",
                   f"127.0.0.1:{svc.ports['gateway']}", "--workload", "sharegpt", "--num-requests", str(n),
                   "--rate", rate, "--vocab", "30000", "--json", "--out", str(out)]
            done = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                                  text=True, timeout=max(10, deadline - time.monotonic()))
            rates[rate] = json.loads(out.read_text()) if out.exists() else {"error": done.stderr[-1500:]}
        result["pagedserve"] = rates
        result["gateway_log_tail"] = svc.tail("gateway", 800)
    finally:
        svc.stop()
    # transformers static batching: batches of 16 in arrival order, left-padded
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(args.device).eval()
    tokens, start = 0, time.perf_counter()
    with torch.inference_mode():
        for i in range(0, min(len(reqs), 64), 16):
            batch = reqs[i:i + 16]
            width = max(len(p) for p, _ in batch)
            ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in batch], device=args.device)
            mask = (torch.arange(width, device=args.device)[None, :] >= torch.tensor(
                [width - len(p) for p, _ in batch], device=args.device)[:, None]).long()
            new = max(o for _, o in batch)
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           pad_token_id=0)
            tokens += sum(o for _, o in batch)  # useful tokens only
            if time.monotonic() > deadline:
                break
    torch.cuda.synchronize()
    result["transformers_static_batch16"] = {"useful_output_tokens_per_s": tokens / (time.perf_counter() - start),
                                             "requests": min(i + 16, len(reqs))}
    del model
    torch.cuda.empty_cache()
    # control-plane share: bench split's RPC time share, a short run
    out = work / "split.json"
    done = subprocess.run([sys.executable, "-m", "pagedserve.cli", "bench", "split", "--model", str(model_dir),
                           "--device", args.device, "--dtype", "bfloat16", "--num-requests", "32",
                           "--output-len", "64", "--out", str(out)],
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                          timeout=max(10, deadline - time.monotonic() + 60))
    result["control_plane"] = json.loads(out.read_text()) if out.exists() else {"error": done.stderr[-1500:]}
    result["status"] = "ok" if "inf" in result["pagedserve"] and "error" not in result["pagedserve"]["inf"] else "failed"
    return result


# ---------------------------------------------------------------- main

def environment(args) -> dict:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for name in ("triton", "transformers", "grpc", "google.protobuf"):
        try:
            env[name] = __import__(name, fromlist=["__version__"]).__version__
        except Exception as e:  # noqa: BLE001
            env[name] = f"missing: {e}"
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(args.device)
        env["gpu_memory_gib"] = torch.cuda.get_device_properties(args.device).total_memory / 2**30
    return env


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
    write(report, args.out)
    work = Path(tempfile.mkdtemp(prefix="gpu_check-"))
    report["work_dir"] = str(work)
    runners = {"kernels": lambda d: part_kernels(args, d), "services": lambda d: part_services(args, d, work),
               "bench": lambda d: part_bench(args, d), "serve": lambda d: part_serve(args, d, work)}
    for name in args.parts:
        t0 = time.monotonic()
        try:
            result = runners[name](t0 + args.budgets[name])
        except Exception as e:  # noqa: BLE001 - every part is recorded, the next still runs
            result = {"status": "error", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
        result["seconds"] = time.monotonic() - t0
        report["parts"][name] = result
        report["elapsed_s"] = time.monotonic() - start
        write(report, args.out)
        print(f"{name}: {result['status']} in {result['seconds']:.0f}s", flush=True)
    bad = [n for n in args.parts if report["parts"][n]["status"] != "ok"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
