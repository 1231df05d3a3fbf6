"""`pagedserve advise`: how many requests fit, paged vs contiguous, and what binds, on paper.

KV bytes per token = 2 (K and V) x layers x KV heads x head size x bytes per element.
The KV budget is the accelerator's memory x utilization, less the weights. A tensor-parallel
group of N accelerators (--tensor-parallel-size) has N times the memory, bandwidth and
compute, and its KV bytes count every rank's heads: with fewer KV heads than ranks each rank
holds a replica of one (pagedserve/executor/sharding.py), so N heads are stored, not the model's. The batch
ceiling is the budget over the tokens each request holds: its mean length when paged
(one partial block of waste), the maximum length when a contiguous region is reserved.
"""
from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import asdict, dataclass

GIB = 1 << 30

# name: (layers, hidden, heads, kv heads, intermediate, vocab, max length, gated mlp)
KNOWN_MODELS = {
    "opt-13b": (40, 5120, 40, 40, 20480, 50272, 2048, False),
    "opt-66b": (64, 9216, 72, 72, 36864, 50272, 2048, False),
    "llama-3-8b": (32, 4096, 32, 8, 14336, 128256, 8192, True),
    "llama-3-70b": (80, 8192, 64, 8, 28672, 128256, 8192, True),
    "smollm2-135m": (30, 576, 9, 3, 1536, 49152, 8192, True),
}
# name: (memory GiB, memory bandwidth GB/s, dense fp16 TFLOP/s)
KNOWN_ACCELERATORS = {
    "a100-40gb": (40, 1555, 312), "a100-80gb": (80, 2039, 312), "h100-80gb": (80, 3350, 989),
    "h200": (141, 4800, 989), "l4": (24, 300, 121),
}


@dataclass
class ModelShape:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_model_len: int
    gated_mlp: bool = True

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def num_parameters(self) -> int:
        h, kv = self.hidden_size, self.num_kv_heads * self.head_size
        attn = h * h * 2 + h * kv * 2
        mlp = (3 if self.gated_mlp else 2) * h * self.intermediate_size
        pos = 0 if self.gated_mlp else self.max_model_len * h  # OPT learns positions
        return self.num_layers * (attn + mlp) + self.vocab_size * h + pos

    def kv_bytes_per_token(self, dtype_bytes: int, tensor_parallel: int = 1) -> int:
        """Over every rank of a group of `tensor_parallel` (KV heads replicated when fewer)."""
        heads = max(self.num_kv_heads, tensor_parallel)
        return 2 * self.num_layers * heads * self.head_size * dtype_bytes


def _hub_config(model: str) -> str | None:
    """A hub id's config.json (pagedserve.executor.hub), None when `model` is not a hub id."""
    from pagedserve.executor import hub
    from pagedserve.executor.errors import ModelLoadError

    if not hub.looks_like_hub_id(model):
        return None
    try:
        return hub.config_file(model)
    except ModelLoadError as e:
        raise ValueError(str(e)) from e


def load_shape(model: str) -> ModelShape:
    if model.lower() in KNOWN_MODELS:
        return ModelShape(model.lower(), *KNOWN_MODELS[model.lower()])
    path = os.path.join(model, "config.json") if os.path.isdir(model) else model
    name = os.path.basename(os.path.dirname(os.path.abspath(path)))
    if not os.path.exists(path):
        path, name = _hub_config(model), model
    if path is None:
        raise ValueError(f"{model!r} is neither a known model ({', '.join(KNOWN_MODELS)}) "
                         "nor a directory with a config.json nor a hub id")
    with open(path) as f:
        c = json.load(f)
    return ModelShape(
        name, c["num_hidden_layers"],
        c["hidden_size"], c["num_attention_heads"],
        c.get("num_key_value_heads", c["num_attention_heads"]), c["intermediate_size"],
        c["vocab_size"], c.get("max_position_embeddings", 2048), True)


@dataclass
class Advice:
    kv_bytes_per_token: int
    weight_bytes: int
    kv_budget_bytes: int
    kv_tokens: int
    paged_batch_ceiling: int
    contiguous_batch_ceiling: int
    ceiling_ratio: float
    binding: str
    explanation: str


def advise(shape: ModelShape, *, memory_gib: float, bandwidth_gbs: float, tflops: float,
           weight_bytes_per_param: float = 2, kv_dtype_bytes: int = 2,
           utilization: float = 0.9, mean_tokens: float = 499, max_len: int | None = None,
           block_size: int = 16, concurrency: float | None = None,
           tensor_parallel: int = 1) -> Advice:
    """mean_tokens: the mean prompt + output length of the workload (ShareGPT-like: 499);
    memory, bandwidth and tflops are one accelerator's, `tensor_parallel` of them in a group."""
    n, kv = tensor_parallel, shape.num_kv_heads
    if n < 1 or (kv >= n and kv % n) or (kv < n and n % kv):
        raise ValueError(f"--tensor-parallel-size {n} cannot split {kv} KV heads evenly "
                         f"(choose a divisor of {kv}, or a multiple of it to replicate them)")
    memory_gib, bandwidth_gbs, tflops = memory_gib * n, bandwidth_gbs * n, tflops * n
    max_len = max_len or shape.max_model_len
    per_token = shape.kv_bytes_per_token(kv_dtype_bytes, n)
    weights = int(shape.num_parameters * weight_bytes_per_param)
    budget = int(memory_gib * GIB * utilization) - weights
    if budget <= 0:
        raise ValueError(f"the weights ({weights / GIB:.1f} GiB) do not fit in "
                         f"{utilization:.0%} of {memory_gib} GiB")
    kv_tokens = budget // per_token
    paged = int(kv_tokens // (block_size * math.ceil(mean_tokens / block_size)))
    contiguous = int(kv_tokens // max_len)
    # one decode step at the paged ceiling: read weights + the batch's KV, compute 2 FLOP/param/token
    batch = paged if concurrency is None else min(paged, concurrency)
    bytes_read = weights + batch * mean_tokens * per_token
    t_bandwidth = bytes_read / (bandwidth_gbs * 1e9)
    t_compute = batch * 2 * shape.num_parameters / (tflops * 1e12)
    binding = "compute" if t_compute > t_bandwidth else "memory bandwidth"
    if concurrency is not None and concurrency <= contiguous:
        binding = "per-token latency"
        why = (f"only {concurrency:g} requests run at once, fewer than even contiguous "
               f"reservation holds ({contiguous}): memory does not bind, so paging buys little; "
               f"each decode step is bound by reading {weights / GIB:.1f} GiB of weights.")
    else:
        why = (f"memory binds the batch: paged allocation fits {paged} requests of "
               f"{mean_tokens:g} tokens, contiguous reservation of {max_len} tokens fits "
               f"{contiguous} ({paged / max(contiguous, 1):.1f}x); at that batch a decode step is "
               f"{binding}-bound ({t_bandwidth * 1e3:.1f} ms to read, {t_compute * 1e3:.1f} ms to "
               f"compute).")
    return Advice(per_token, weights, budget, int(kv_tokens), paged, contiguous,
                  paged / max(contiguous, 1), binding, why)


def add_parser(sub) -> None:
    p = sub.add_parser("advise", help="KV memory, batch ceilings and the binding resource",
                       description="Estimate KV bytes per token, the batch-size ceiling under "
                                   "paged and contiguous allocation, and which resource binds.")
    p.add_argument("--model", help=f"a model directory, a hub id (its config.json alone is "
                                   f"read) or one of: {', '.join(KNOWN_MODELS)}; also positional")
    p.add_argument("--accelerator", default="a100-40gb", choices=sorted(KNOWN_ACCELERATORS))
    p.add_argument("--memory-gib", type=float, default=None, help="override accelerator memory")
    p.add_argument("--weights-bytes", type=float, default=2, help="bytes per weight (fp16: 2)")
    p.add_argument("--kv-bytes", type=int, default=2, help="bytes per KV element (fp16: 2)")
    p.add_argument("--utilization", type=float, default=0.9, help="fraction of memory used")
    p.add_argument("--mean-tokens", type=float, default=499,
                   help="mean prompt + output tokens of the workload (ShareGPT-like: 499)")
    p.add_argument("--max-len", type=int, default=None, help="contiguous reservation length")
    p.add_argument("--concurrency", type=float, default=None,
                   help="requests in flight at your load, if known")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="a group of N accelerators serving the model (memory, bandwidth and "
                        "compute times N; KV bytes count every rank's heads, replicas included)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run)


def run(args) -> int:
    try:
        if args.model is None:
            raise ValueError("name a model: pagedserve advise MODEL (or --model MODEL)")
        shape = load_shape(args.model)
    except ValueError as e:
        print(f"pagedserve advise: {e}", file=sys.stderr)
        return 2
    mem, bw, tf = KNOWN_ACCELERATORS[args.accelerator]
    a = advise(shape, memory_gib=args.memory_gib or mem, bandwidth_gbs=bw, tflops=tf,
               weight_bytes_per_param=args.weights_bytes, kv_dtype_bytes=args.kv_bytes,
               utilization=args.utilization, mean_tokens=args.mean_tokens, max_len=args.max_len,
               concurrency=args.concurrency, tensor_parallel=args.tensor_parallel_size)
    if args.json:
        print(json.dumps(asdict(a), indent=1))
        return 0
    print(f"{shape.name}: {shape.num_parameters / 1e9:.2f} B parameters, "
          f"{a.kv_bytes_per_token / 1024:.0f} KiB of KV per token")
    print(f"KV budget {a.kv_budget_bytes / GIB:.1f} GiB = {a.kv_tokens} tokens")
    print(f"batch ceiling: paged {a.paged_batch_ceiling}, contiguous "
          f"{a.contiguous_batch_ceiling} ({a.ceiling_ratio:.1f}x); binds: {a.binding}")
    print(a.explanation)
    return 0
