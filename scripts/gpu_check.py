"""One GPU check of pagedserve, written to one JSON file (see scripts/gpu_check.sh).

Parts (each bounded in time, each recorded even when it fails; the file is rewritten as each
part's steps end, so a cut still leaves what finished; service logs go next to it):
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
STATUSES = ("pending", "running", "skipped", "ok", "failed", "error")


def default_out() -> str:
    """$OUT/gpu_check.json where $OUT is set (the device machine returns what is written
    there), else bench_results/gpu_check.json."""
    base = os.environ.get("OUT")
    return str(Path(base) / "gpu_check.json") if base else "bench_results/gpu_check.json"


def child_env() -> dict:
    """The environment of a child process: the repository ahead of any PYTHONPATH already
    set, which stays (wheels installed with `pip --target` must remain importable)."""
    old = os.environ.get("PYTHONPATH")
    return dict(os.environ, PYTHONPATH=str(ROOT) + (os.pathsep + old if old else ""))


class Cut(BaseException):
    """SIGTERM (the outer `timeout`): ends the running part, whose services stop, and the
    report is written before the process exits."""


def on_sigterm(signum, frame):
    raise Cut("SIGTERM: the outer time limit cut the run")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=default_out(), help="the JSON file to write (default: $OUT/gpu_check.json "
                   "when $OUT is set, else bench_results/gpu_check.json); service logs go to OUT-logs/")
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
    args.logs = Path(args.out).with_name(Path(args.out).stem + "-logs")
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


# ---------------------------------------------------------------- shared helpers (torch)

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_paged(torch, num_seqs, context, q_len, num_heads, num_kv, head, block, dtype, device, seed=0,
               mixed=False, pad=0, poison=False):
    """A random pool with each sequence's blocks shuffled, and the kernel arguments.

    mixed: sequence lengths drawn in [q_len, context] (the last one `context`); pad: extra
    table columns past the widest sequence, naming block 0; poison: block 0 and every slot
    past a sequence's length hold NaN (a kernel that reads them returns NaN)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    per_seq = -(-context // block)
    num_blocks = num_seqs * per_seq + 1
    pool = torch.randn((num_blocks, 2, block, num_kv, head), generator=gen, device=device).to(dtype)
    tables = (torch.randperm(num_blocks - 1, generator=gen, device=device)[: num_seqs * per_seq] + 1)
    tables = tables.view(num_seqs, per_seq).to(torch.int32)
    if mixed:
        lens = torch.randint(max(q_len, 1), context + 1, (num_seqs,), generator=gen, device=device)
        lens[-1] = context
    else:
        lens = torch.full((num_seqs,), context, device=device)
    if pad:
        tables = torch.cat([tables, tables.new_zeros((num_seqs, pad))], 1)
    if poison:
        pool[0] = float("nan")
        for b, n in enumerate(lens.tolist()):
            last = tables[b, (n - 1) // block].item()
            pool[last, :, (n - 1) % block + 1:] = float("nan")
            for j in range(-(-n // block), per_seq):
                pool[tables[b, j].item()] = float("nan")
    q_lens = torch.clamp(lens, max=q_len)
    starts = torch.zeros(num_seqs + 1, dtype=torch.int32, device=device)
    starts[1:] = torch.cumsum(q_lens, 0)
    q = torch.randn((int(starts[-1]), num_heads, head), generator=gen, device=device).to(dtype)
    return dict(q=q, k_cache=pool[:, 0], v_cache=pool[:, 1], block_tables=tables,
                seq_lens=lens.to(torch.int32), query_start_loc=starts)


def dense_reference(torch, a, scale):
    """Causal attention of make_paged's arguments in float32, one sequence at a time, reading
    only each sequence's own tokens (independent of kernels/)."""
    k_cache, v_cache, q = a["k_cache"], a["v_cache"], a["q"]
    block, num_kv = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    starts = a["query_start_loc"].tolist()
    for b, n in enumerate(a["seq_lens"].tolist()):
        ids = a["block_tables"][b, : -(-n // block)].long()
        k = k_cache[ids].reshape(-1, num_kv, k_cache.shape[3])[:n].float().repeat_interleave(group, 1)
        v = v_cache[ids].reshape(-1, num_kv, v_cache.shape[3])[:n].float().repeat_interleave(group, 1)
        qs = q[starts[b]:starts[b + 1]].float()
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale
        rows = torch.arange(n - len(qs), n, device=q.device)[:, None]
        scores = scores.masked_fill(torch.arange(n, device=q.device)[None, :] > rows, float("-inf"))
        out[starts[b]:starts[b + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


REL_TOL = {"float32": 1e-4, "float16": 3e-3, "bfloat16": 2e-2}  # relative L2 error vs float32


def compare_attention(torch, kernel, a, scale, splits=None):
    """The kernel's output (written over NaN) against dense_reference: relative L2 and max
    errors, whether it is finite, and ok."""
    out = torch.full_like(a["q"], float("nan"))
    kernel(**a, scale=scale, out=out, **({"num_splits": splits} if splits else {}))
    ref = dense_reference(torch, a, scale)
    diff = out.float() - ref
    rel_l2 = (diff.norm() / ref.norm()).item()
    rel_max = (diff.abs().max() / ref.abs().max()).item()
    finite = bool(torch.isfinite(out).all())
    dtype = str(a["q"].dtype).removeprefix("torch.")
    return dict(rel_l2=rel_l2, rel_max=rel_max, finite=finite, ok=finite and rel_l2 <= REL_TOL[dtype])


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

def check_swap(torch, device) -> bool:
    """Blocks through host memory and back (memsvc.host_pool), each way waited for before the
    next reads it (swap_copy only queues the copy)."""
    from memsvc.host_pool import finish_copies, swap_copy

    pool = torch.randn((32, 2, 2, 16, 4, 64), device=device)
    host = torch.empty((16, 2, 2, 16, 4, 64), pin_memory=torch.device(device).type == "cuda")
    swap_copy(pool, host, [3, 9, 4, 5], [0, 1, 2, 7])
    finish_copies(pool)  # the device-to-host copy must land before the swap-in reads `host`
    back = torch.zeros_like(pool)
    swap_copy(host, back, [0, 1, 2, 7], [3, 9, 4, 5])
    finish_copies(back)
    return all(torch.equal(back[i], pool[i]) for i in (3, 9, 4, 5))


def attention_cases(quick):
    """(dtype name, head, gqa, block, seqs, context, q_len, splits): every case mixes lengths,
    pads its table and poisons what lies past each sequence."""
    contexts = [(8, 1), (4, 3000), (1, 8192)] if quick else [(64, 1), (64, 300), (8, 2048), (2, 8192), (1, 5000)]
    for dtype in ("bfloat16", "float16", "float32"):
        for head in (64, 128):
            for gqa in (1, 4, 8):
                for block in (16, 32):
                    for num_seqs, context in contexts:
                        for q_len, splits in ((1, None), (1, 4), (min(context, 128), None)):
                            if q_len > 1 and num_seqs > 8:
                                continue
                            yield dtype, head, gqa, block, num_seqs, context, q_len, splits


def part_kernels(args, part: Part):
    import torch

    from kernels.copy_blocks_ref import copy_blocks_ref
    from kernels.copy_blocks_triton import copy_blocks_triton
    from kernels.paged_attention_triton import paged_attention_triton
    from kernels.store_kv_ref import store_kv_ref
    from kernels.store_kv_triton import store_kv_triton

    device = args.device
    cases, failures = part.put("cases", []), 0
    for name in ("bfloat16", "float16", "float32"):  # store_kv and copy_blocks first: exact, cheap
        dtype = getattr(torch, name)
        pool = torch.randn((64, 4, 2, 16, 8, 128), device=device).to(dtype)
        expect = pool.clone()
        slots = torch.randperm(64 * 16, device=device)[:300]
        slots[::7] = -1
        key = torch.randn((300, 8, 128), device=device).to(dtype)
        value = torch.randn((300, 8, 128), device=device).to(dtype)
        store_kv_triton(key, value, pool[:, 2, 0], pool[:, 2, 1], slots)
        store_kv_ref(key, value, expect[:, 2, 0], expect[:, 2, 1], slots)
        ok = torch.equal(pool, expect)
        cases.append(dict(kernel="store_kv", dtype=name, ok=ok))
        failures += not ok
        src, dst = torch.arange(0, 20, device=device), torch.arange(40, 60, device=device)
        copy_blocks_triton(pool, pool, src, dst)
        copy_blocks_ref(expect, expect, src, dst)
        ok = torch.equal(pool, expect)
        cases.append(dict(kernel="copy_blocks", dtype=name, ok=ok))
        failures += not ok
    ok = check_swap(torch, device)
    cases.append(dict(kernel="swap_copy", ok=ok))
    failures += not ok
    part.save()
    for name, head, gqa, block, num_seqs, context, q_len, splits in attention_cases(args.quick):
        if part.over():
            part.put("failures", failures)
            return {"status": "failed", "reason": "time budget", "num_cases": len(cases)}
        num_kv = 2 if gqa > 1 else 8
        a = make_paged(torch, num_seqs, context, q_len, num_kv * gqa, num_kv, head, block, getattr(torch, name),
                       device, mixed=num_seqs > 1, pad=3, poison=True)
        result = compare_attention(torch, paged_attention_triton, a, head ** -0.5, splits)
        failures += not result["ok"]
        cases.append(dict(kernel="paged_attention", dtype=name, head=head, gqa=gqa, block=block, seqs=num_seqs,
                          context=context, q_len=q_len, splits=splits or "auto", **result))
        if len(cases) % 20 == 0:
            part.save()
    return {"status": "ok" if failures == 0 else "failed", "num_cases": len(cases), "failures": failures}


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
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs = {}

    def _start(self, name, argv):
        log = open(self.log_dir / f"{name}.log", "ab")
        env = child_env()
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

    def memsvc_stats(self):
        """memsvc's PoolStats (preemption counts in .preemption)."""
        import grpc

        from wire import convert
        from wire.v1 import memory_pb2, memory_pb2_grpc

        with grpc.insecure_channel(f"127.0.0.1:{self.ports['memsvc']}") as channel:
            reply = memory_pb2_grpc.MemoryManagerStub(channel).Stats(memory_pb2.StatsRequest(), timeout=10)
        return convert.stats_from_proto(reply)

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

def hf_sampled(model_dir, ids, dtype, device, **generate):
    """transformers' generate for one prompt, every returned sequence's new tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    with torch.inference_mode():
        y = model.generate(torch.tensor([ids], device=device), pad_token_id=0, **generate)
    del model
    return [row[len(ids):].tolist() for row in y]


def part_services(args, part: Part, work: Path):
    import threading

    import torch

    from wire.protocol import SamplingParams

    def over(step):
        if not part.over():
            return False
        part.put("reason", f"time budget, before {step}")
        return True

    model_dir = build_model(work / "tiny-llama", hidden=512, layers=4, heads=8, kv_heads=2, inter=1024)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 4000, (n,), generator=gen).tolist() for n in (5, 17, 40, 100)]
    max_new = 24
    dtype = "float32"  # identity with transformers needs the same arithmetic's rounding
    part.put("model", "random Llama 512x4 (GQA 4)")
    part.put("dtype", dtype)
    expected = hf_greedy(model_dir, prompts, max_new, dtype, args.device)
    beam_expected = hf_sampled(model_dir, prompts[2], dtype, args.device, max_new_tokens=12, min_new_tokens=12,
                               num_beams=4, num_return_sequences=4, do_sample=False, early_stopping=True)
    greedy = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
    if over("starting the services"):
        return {"status": "failed"}
    svc = Services(model_dir, args.device, dtype, log_dir=args.logs / "services").start(min(120, part.left()))
    try:
        got = [svc.generate(ids, greedy)[0] for ids in prompts]
        part.put("greedy_equal", [g == e for g, e in zip(got, expected)])
        if over("n=4"):
            return {"status": "failed"}
        n4 = svc.generate(prompts[1], SamplingParams(max_tokens=16, temperature=0.8, n=4, seed=7, ignore_eos=True))
        n4_again = svc.generate(prompts[1], SamplingParams(max_tokens=16, temperature=0.8, n=4, seed=7,
                                                           ignore_eos=True))
        n4_greedy = svc.generate(prompts[1], SamplingParams(max_tokens=16, temperature=0.0, n=4, ignore_eos=True))
        part.put("n4", {"completions": len(n4), "lengths": [len(c) for c in n4], "seeded_repeat_equal": n4 == n4_again,
                        "distinct": len({tuple(c) for c in n4}),
                        "greedy_each_equal_transformers": [c == expected[1][:16] for c in n4_greedy]})
        beams = svc.generate(prompts[2], SamplingParams(max_tokens=12, beam_width=4, n=4, ignore_eos=True))
        part.put("beam4", {"completions": len(beams), "equal_to_transformers": beams == beam_expected,
                           "first_equal": bool(beams) and beams[0] == beam_expected[0]})
        if over("SIGKILL of the executor"):
            return {"status": "failed"}
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
        held = svc.memsvc_stats().num_sequences  # > 0: the kill lands while requests are mid-run
        svc.procs["executor"].send_signal(signal.SIGKILL)
        svc.procs["executor"].wait()
        svc.start_executor()
        for t in threads:
            t.join(max(1.0, part.left()))
        alone = [svc.generate(ids, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))[0]
                 for ids in prompts]
        part.put("sigkill_executor", {"errors": errors, "sequences_held_at_kill": held,
                                      "same_outputs": [outs.get(i) == alone[i] for i in range(len(prompts))]})
    finally:
        svc.stop()
    if over("swap under a tiny pool"):
        return {"status": "failed"}
    tiny = Services(model_dir, args.device, dtype, log_dir=args.logs / "swap",
                    extra_memsvc=["--kv-tokens", "256", "--preemption-mode", "swap", "--swap-space", "1"])
    tiny.start(min(120, part.left()))
    try:
        outs = {}
        threads = [threading.Thread(target=lambda i=i: outs.__setitem__(i, tiny.generate(
            prompts[i], SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))[0])) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(1.0, part.left()))
        preemption = tiny.memsvc_stats().preemption
        alone = [tiny.generate(ids, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))[0]
                 for ids in prompts]
        part.put("swap_tiny_pool", {"same_outputs": [outs.get(i) == alone[i] for i in range(4)],
                                    "swapped_out": preemption["num_swapped_out"],
                                    "swapped_in": preemption["num_swapped_in"]})
    finally:
        tiny.stop()
    return {"status": "ok" if services_ok(part.result) else "failed"}


def services_ok(r: dict) -> bool:
    """Every step of the services part ran and passed (a missing step fails)."""
    try:
        kill, swap = r["sigkill_executor"], r["swap_tiny_pool"]
        return (all(r["greedy_equal"]) and r["n4"]["completions"] == 4 and r["n4"]["seeded_repeat_equal"]
                and len(r["n4"]["greedy_each_equal_transformers"]) == 4 and all(r["n4"]["greedy_each_equal_transformers"])
                and r["beam4"]["equal_to_transformers"] and not kill["errors"] and kill["sequences_held_at_kill"] > 0
                and all(kill["same_outputs"]) and all(swap["same_outputs"])
                and swap["swapped_out"] == swap["swapped_in"] > 0)
    except (KeyError, TypeError):
        return False


# ---------------------------------------------------------------- part 3: kernel bandwidth

def part_bench(args, part: Part):
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
        part.put("rows", rows)
        if part.over():
            part.put("reason", "time budget")
            break
    goal = next((r for r in rows if r["seqs"] == 256 and r["context"] == 2048 and r["block"] == 16), None)
    part.put("copy_gb_per_s", copy_gbs)
    result = {"goal_bandwidth_80pct": None if goal is None else goal["fraction_of_copy"] >= 0.8,
              "goal_overhead_10pct": None if goal is None else goal["paged_over_dense"] <= 0.10}
    # ok: the goal shape was measured (the goals themselves are reported, not required)
    result["status"] = "ok" if goal is not None and all(r["paged_ms"] > 0 for r in rows) else "failed"
    return result


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


def part_serve(args, part: Part, work: Path):
    import asyncio  # noqa: F401 - the load generator's

    import torch

    model_dir = build_model(work / "llama-1b", hidden=2048, layers=16, heads=32, kv_heads=8, inter=8192,
                            vocab=32000, max_pos=4096, std=0.02)
    n = 40 if args.quick else 150
    reqs = sharegpt_like(n)
    result = {"model": "random Llama 1B shape (2048x16, GQA 4, vocab 32k), bfloat16", "num_requests": n}
    svc = Services(model_dir, args.device, "bfloat16", log_dir=args.logs / "serve",
                   extra_memsvc=["--kv-memory", "40"]).start(timeout=min(240, max(1.0, part.left())))
    try:
        rates = {}
        for rate in ("4", "16", "inf"):
            if part.over():
                part.put("reason", "time budget")
                break
            out = work / f"serve-{rate}.json"
            cmd = [sys.executable, "-m", "pagedserve.cli", "bench", "serve", "--server",
                   f"127.0.0.1:{svc.ports['gateway']}", "--workload", "sharegpt", "--num-requests", str(n),
                   "--rate", rate, "--vocab", "30000", "--json", "--out", str(out)]
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
            if part.over():
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
                          cwd=ROOT, env=child_env(), capture_output=True, text=True,
                          timeout=max(10, part.left() + 60))
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
    report["logs"] = str(args.logs)
    signal.signal(signal.SIGTERM, on_sigterm)
    runners = {"kernels": lambda p: part_kernels(args, p), "services": lambda p: part_services(args, p, work),
               "bench": lambda p: part_bench(args, p), "serve": lambda p: part_serve(args, p, work)}
    for name in args.parts:
        t0 = time.monotonic()
        part = Part(report, name, t0 + args.budgets[name], lambda: write(report, args.out))
        cut = None
        try:
            part.result.update(runners[name](part))
        except Cut as e:
            cut = e
            part.result.update(status="error", error=str(e))
        except Exception as e:  # noqa: BLE001 - every part is recorded, the next still runs
            part.result.update(status="error", error=f"{type(e).__name__}: {e}",
                               traceback=traceback.format_exc()[-4000:])
        part.result["seconds"] = time.monotonic() - t0
        report["elapsed_s"] = time.monotonic() - start
        write(report, args.out)
        print(f"{name}: {part.result['status']} in {part.result['seconds']:.0f}s", flush=True)
        if cut is not None:
            break
    bad = [n for n in args.parts if report["parts"][n]["status"] != "ok"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
