"""A simulated accelerator: the zero-cost executor that waits a modeled step time per Execute.

`pagedserve executor --simulate MODEL_SHAPE@GPU` (or `--simulate-step-ms MS`) serves it. It
answers as pagedserve.executor.zero_cost does (same minimal KV geometry, one fixed token per sampling
sequence) once a modeled step time has passed on a simulated device: a step launched while
another runs starts when that one ends (pagedserve.executor.step_merger launches ahead), the waits
release the GIL and use no CPU, so the control plane around it runs as it would beside a busy
GPU. `simulated_seconds` is the device's busy time (the sum of the modeled times), `num_steps`
the steps answered; an empty step takes no time.

Step time (roofline): max(memory, compute) + LAUNCH_OVERHEAD_S, where
  memory  = (params * 2 bytes (bf16 weights) + KV bytes read) / memory bandwidth
  KV read = sum over sequences of (start_pos + len(token_ids)) * 2 * layers * kv_heads * head_dim * 2 bytes
  compute = 2 * params * tokens computed in the step / dense BF16 matmul FLOP/s.
Attention FLOPs, sampling and capacity are not modeled (llama-70b's 141 GB of bf16 weights do not
fit one H200 with a KV cache; the time is what one chip's bandwidth would give).

Published figures used (vendor datasheets, model cards' config.json):
  GPUs: H200 SXM 4.8 TB/s HBM3e, 989 TFLOP/s dense BF16; H100 SXM 3.35 TB/s, 989 TFLOP/s;
        A100 80GB SXM 2.0 TB/s, 312 TFLOP/s; L40S 864 GB/s, 362 TFLOP/s.
  Models (params, layers, KV heads, head dim): Llama 3.2 1B 1.24B, 16, 8, 64;
        Llama 3.2 3B 3.21B, 28, 8, 128; Llama 3.1 8B 8.03B, 32, 8, 128;
        Llama 3.1 70B 70.6B, 80, 8, 128; Qwen2 7B 7.62B, 28, 4, 128;
        SmolLM2 135M 0.135B, 30, 3, 64.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from pagedserve.executor.step_merger import Launched
from pagedserve.executor.zero_cost import ZeroCostExecutor
from pagedserve.step.step_batch import StepBatch

LAUNCH_OVERHEAD_S = 0.5e-3  # kernel launches and host sync of one step, stated not measured


@dataclass(frozen=True)
class ModelShape:
    published: str
    params: float
    layers: int
    kv_heads: int
    head_dim: int

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * 2  # K and V, bf16

    def __str__(self) -> str:
        return (f"{self.published} ({self.params / 1e9:.3g}B params, {self.layers} layers, "
                f"{self.kv_heads} KV heads x {self.head_dim})")


@dataclass(frozen=True)
class Gpu:
    published: str
    bandwidth: float  # bytes/s
    flops: float  # dense BF16 matmul FLOP/s

    def __str__(self) -> str:
        return f"{self.published} ({self.bandwidth / 1e12:.3g} TB/s, {self.flops / 1e12:.0f} TFLOP/s)"


SHAPES = {
    "llama-1b": ModelShape("Llama 3.2 1B", 1.24e9, 16, 8, 64),
    "llama-3b": ModelShape("Llama 3.2 3B", 3.21e9, 28, 8, 128),
    "llama-8b": ModelShape("Llama 3.1 8B", 8.03e9, 32, 8, 128),
    "llama-70b": ModelShape("Llama 3.1 70B", 70.6e9, 80, 8, 128),
    "qwen2-7b": ModelShape("Qwen2 7B", 7.62e9, 28, 4, 128),
    "smollm2-135m": ModelShape("SmolLM2 135M", 0.135e9, 30, 3, 64),
}
GPUS = {
    "h200": Gpu("H200 SXM HBM3e", 4.8e12, 989e12),
    "h100": Gpu("H100 SXM", 3.35e12, 989e12),
    "a100-80gb": Gpu("A100 80GB SXM", 2.0e12, 312e12),
    "l40s": Gpu("L40S", 864e9, 362e12),
}
SPEC_HELP = ("MODEL_SHAPE@GPU; shapes: " + "; ".join(f"{k} = {v}" for k, v in SHAPES.items())
             + ". GPUs (memory bandwidth, dense BF16): " + "; ".join(f"{k} = {v}" for k, v in GPUS.items())
             + f". Step = max(bf16 weights + KV read over bandwidth, 2 x params x tokens over FLOP/s) "
             f"+ {LAUNCH_OVERHEAD_S * 1e3:g} ms launch overhead (pagedserve/executor/simulated.py)")


@dataclass(frozen=True)
class Roofline:
    shape: ModelShape
    gpu: Gpu

    def step_seconds(self, batch: StepBatch) -> float:
        tokens = int(batch.num_tokens.sum())
        context = int((batch.start_pos + batch.num_tokens).sum())
        memory = (self.shape.params * 2 + context * self.shape.kv_bytes_per_token) / self.gpu.bandwidth
        compute = 2 * self.shape.params * tokens / self.gpu.flops
        return max(memory, compute) + LAUNCH_OVERHEAD_S


def parse_spec(spec: str) -> Roofline:
    """'llama-8b@h200' -> its Roofline; ValueError naming the known shapes and GPUs."""
    shape, _, gpu = spec.strip().lower().partition("@")
    if shape not in SHAPES or gpu not in GPUS:
        raise ValueError(f"--simulate {spec!r}: want MODEL_SHAPE@GPU with a shape of "
                         f"{', '.join(SHAPES)} and a GPU of {', '.join(GPUS)} (e.g. llama-8b@h200)")
    return Roofline(SHAPES[shape], GPUS[gpu])


class SimulatedExecutor(ZeroCostExecutor):
    """ZeroCostExecutor on a simulated device that takes `step_ms` or the roofline of `spec`
    per step. `launch` queues a step on the device as a GPU stream would (it starts when the
    step before it ends, or now if the device is idle) and returns at once with its outputs
    (the fixed token: known at launch, as a sample resolved on the device would be to the
    next step) and when it ends; `execute` also sleeps until then."""

    def __init__(self, block_size: int = 16, max_model_len: int = 8192, tokenizer_dir: str = "",
                 *, spec: str | None = None, step_ms: float | None = None, sleep=time.sleep,
                 clock=time.monotonic):
        if (spec is None) == (step_ms is None):
            raise ValueError("a simulated executor takes one of --simulate and --simulate-step-ms")
        super().__init__(block_size, max_model_len, tokenizer_dir)
        self.roofline = parse_spec(spec) if spec is not None else None
        self.step_ms = step_ms
        self.sleep = sleep
        self.clock = clock
        self.simulated_seconds = 0.0  # the device's busy time: every step's modeled time
        self.free_at = 0.0  # when the device ends the last step launched
        self.info.name = f"simulated:{spec.strip().lower()}" if spec else f"simulated:{step_ms:g}ms"

    def step_seconds(self, batch: StepBatch) -> float:
        return self.roofline.step_seconds(batch) if self.roofline else self.step_ms / 1e3

    def launch(self, batch: StepBatch) -> Launched:
        seconds = self.step_seconds(batch) if batch.num_seqs else 0.0
        outputs = super().execute(batch)
        if not seconds:
            return Launched(outputs)
        self.free_at = max(self.clock(), self.free_at) + seconds
        self.simulated_seconds += seconds
        return Launched(outputs, seconds, self.free_at)

    def execute(self, batch: StepBatch):
        launched = self.launch(batch)
        left = launched.ends_at - self.clock()
        if left > 0:
            self.sleep(left)
        return launched.outputs
