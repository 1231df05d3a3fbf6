"""The executor's in-process object: a loaded model that runs steps on an attached pool."""
from __future__ import annotations

import json
import os

import torch

from executor import linear_backend as linear_backends
from executor.default_model import DEFAULT_GGUF, resolve_model
from executor.model_loader import load_model
from executor.logits_mask import GuidedDecoding
from executor.model_runner import ModelRunner
from executor.weights import parse_dtype
from wire.protocol import KVGeometry, ModelInfo, SampleOutput, StepBatch


class Executor:
    """Executor(model, dtype, block_size, device, linear_backend): load `model` (None: the
    default model; a Hugging Face directory; a .gguf file, converted once and cached), its
    linear layers multiplying by `linear_backend` (executor.linear_backend: "auto" times the
    candidates on this machine; linear_plan holds the choice per weight shape).

    model_info() says what the gateway and memsvc need; attach_pool(pool) hands over the KV
    pool (shape KVGeometry.pool_shape(num_blocks), this dtype, on this device), again after
    memsvc re-creates it; execute(batch) runs one step.
    """

    def __init__(self, model: str | None = None, dtype: str = "float32", block_size: int = 16,
                 device: str = "cpu", linear_backend: str = "auto"):
        parse_dtype(dtype)
        if torch.device(device).type == "cpu":
            use_owned_cores()
        self.dtype = dtype
        self.block_size = block_size
        self.device = torch.device(device)
        self.model_dir = resolve_model(model)
        planner = linear_backends.Planner(linear_backend, self.device, parse_dtype(dtype))
        self.model, self.config = load_model(self.model_dir, dtype, on_built=planner.place)
        self.model.to(self.device)
        self.linear_plan = planner.finish()
        self.name = _model_name(model, self.model_dir)
        self.runner: ModelRunner | None = None
        self.guided = GuidedDecoding(self.model_dir, self.config.vocab_size,
                                     list(self.config.eos_token_ids))  # loads on first use

    def kv_geometry(self) -> KVGeometry:
        c = self.config
        return KVGeometry(num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_size=c.head_dim,
                          block_size=self.block_size, dtype=self.dtype, window=c.kv_window or 0)

    def model_info(self) -> ModelInfo:
        return ModelInfo(
            name=self.name,
            max_model_len=self.config.max_model_len,
            vocab_size=self.config.vocab_size,
            eos_token_ids=list(self.config.eos_token_ids),
            chat_template=read_chat_template(self.model_dir),
            tokenizer_dir=self.model_dir,
            kv=self.kv_geometry(),
        )

    def attach_pool(self, pool: torch.Tensor) -> None:
        """Use `pool` for the KV cache from now on (ValueError if it does not fit the model)."""
        if pool.device.type != self.device.type:
            raise ValueError(f"KV pool is on {pool.device}, the model on {self.device}")
        if pool.shape[3] != self.block_size:
            raise ValueError(f"KV pool block size {pool.shape[3]} differs from {self.block_size}")
        if self.runner is None:
            self.runner = ModelRunner(self.model, self.config, pool)
            self.runner.guided = self.guided
        else:
            self.runner.attach_pool(pool)

    def execute(self, batch: StepBatch) -> list[SampleOutput]:
        """Run one step: one SampleOutput per sequence that reports (samples, or returns
        prompt logprobs: SeqStep.reports), in batch order."""
        if self.runner is None:
            raise RuntimeError("no KV pool attached: call attach_pool first")
        return self.runner.execute(batch)


def use_owned_cores() -> None:
    """At most one torch compute thread per core this process may run on: its CPU affinity,
    which a container or taskset narrows below the machine's cores torch counts by default
    (more threads than cores only wait on each other). Never raises a count someone set
    lower; OMP_NUM_THREADS wins."""
    if os.environ.get("OMP_NUM_THREADS") or not hasattr(os, "sched_getaffinity"):
        return
    cores = len(os.sched_getaffinity(0))
    if cores and torch.get_num_threads() > cores:
        torch.set_num_threads(cores)


def _model_name(model: str | None, model_dir: str) -> str:
    if model is None:
        return DEFAULT_GGUF.split(".")[0]
    base = os.path.basename(os.path.normpath(model))
    return base[: -len(".gguf")] if base.endswith(".gguf") else base


def read_chat_template(model_dir: str) -> str | None:
    """The chat template from chat_template.jinja or tokenizer_config.json, if any."""
    path = os.path.join(model_dir, "chat_template.jinja")
    if os.path.exists(path):
        with open(path) as f:
            return f.read()
    path = os.path.join(model_dir, "tokenizer_config.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        template = json.load(f).get("chat_template")
    if isinstance(template, list):  # named templates: use "default"
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template
