"""The executor's in-process object: a loaded model that runs steps on an attached pool."""
from __future__ import annotations

import json
import logging
import os
import time

import torch

from pagedserve.executor import linear_backend as linear_backends
from pagedserve.executor.core_share import CoreShare
from pagedserve.executor.cuda_graphs import DEFAULT_MAX_BATCH
from pagedserve.executor.model_source import resolve_model, served_name
from pagedserve.executor.model_config import ModelConfig
from pagedserve.executor.model_loader import load_model
from pagedserve.executor.logits_mask import GuidedDecoding
from pagedserve.executor.malloc_reuse import reuse_freed_memory
from pagedserve.executor.model_runner import ModelRunner
from pagedserve.executor.sharding import ShardPlan
from pagedserve.executor.step_merger import Launched, launch_of
from pagedserve.executor import tensor_parallel, tp_pools
from pagedserve.executor.weights import parse_dtype
from pagedserve.step.step_batch import StepBatch
from pagedserve.wire.protocol import KVGeometry, ModelInfo
from pagedserve.wire.step_outputs import StepOutputs

log = logging.getLogger(__name__)


class Executor:
    """Executor(model, dtype, block_size, device, linear_backend): load `model` (None: the
    default model; a hub id at `revision`, a Hugging Face directory or a .gguf file:
    pagedserve.executor.model_source), named by the first of `served_model_name` (off:
    model_source.served_name), its
    linear layers multiplying by `linear_backend` (pagedserve.executor.linear_backend: "auto" times the
    candidates on this machine; linear_plan holds the choice per weight shape). model_impl:
    --model-impl (pagedserve.executor.model_config.MODEL_IMPLS); a tensor-parallel group is native.

    kv_cache_dtype: the pool's dtype (--kv-cache-dtype; "auto": `dtype`); another than
    `dtype` on the CPU only (the GPU attention kernel takes the model's dtype).

    model_info() says what the gateway and memsvc need; attach_pool(pool) hands over the KV
    pool (shape KVGeometry.pool_shape(num_blocks), this dtype, on this device), again after
    memsvc re-creates it; execute(batch) runs one step.

    tensor_parallel_size N > 1: this is rank 0 of a group of N processes, each holding its
    shard of the model (pagedserve.executor.tensor_parallel; ValueError when the model does not split
    N ways); a lost rank calls on_group_lost(why) and fails every later step. `rank`
    (rank, address) joins a group led elsewhere instead (pagedserve.executor.tp_worker); `group` (an
    pagedserve.executor.tp_group.GroupLayout) says where the group meets and which ranks run here.
    """

    def __init__(self, model: str | None = None, dtype: str = "float32", block_size: int = 16,
                 device: str = "cpu", linear_backend: str = "auto", tensor_parallel_size: int = 1,
                 group_timeout: float = tensor_parallel.DEFAULT_TIMEOUT_S, on_group_lost=None,
                 rank: tuple[int, str] | None = None, group=None, revision: str | None = None,
                 served_model_name: list[str] | str | None = None, model_impl: str = "auto",
                 kv_cache_dtype: str = "auto"):
        parse_dtype(dtype)
        if torch.device(device).type == "cpu":
            use_owned_cores()
            reuse_freed_memory()
        self.dtype = dtype
        self.kv_dtype = kv_cache_dtype_of(kv_cache_dtype, dtype, torch.device(device))
        self.block_size = block_size
        self.device = torch.device(device)
        self.model_dir = resolve_model(model, revision)
        self.plan = self.leader = None
        if tensor_parallel_size > 1 and ModelConfig.from_dir(self.model_dir, model_impl).impl == "transformers":
            raise ValueError("--tensor-parallel-size > 1 splits native models only: the Transformers "
                             "backend runs in one process (use --model-impl native, or leave it)")
        if tensor_parallel_size > 1:
            self._join(tensor_parallel_size, rank, group_timeout, on_group_lost,
                       dict(model=self.model_dir, dtype=dtype, block_size=block_size, device=device,
                            linear_backend=linear_backend, kv_cache_dtype=self.kv_dtype), group)
        planner = linear_backends.Planner(linear_backend, self.device, parse_dtype(dtype))
        self.model, self.config = load_model(self.model_dir, dtype, on_built=planner.place, plan=self.plan,
                                             impl=model_impl)
        if self.plan is not None:
            tensor_parallel.shard_model(self.model, self.plan)
        self.model.to(self.device)
        self.linear_plan = planner.finish()
        # a group's ranks share the cores by design: each keeps its count
        self.core_share = (CoreShare.for_this_process() if self.device.type == "cpu" and tensor_parallel_size == 1
                           and rank is None else None)
        self.name = served_name(model, self.model_dir, served_model_name)
        self.runner: ModelRunner | None = None
        self.guided = GuidedDecoding(self.model_dir, self.config.vocab_size,
                                     list(self.config.eos_token_ids))  # loads on first use

    def _join(self, world: int, rank: tuple[int, str] | None, timeout: float, on_lost, args: dict,
              group=None) -> None:
        if self.device.type != "cpu":
            raise ValueError("--tensor-parallel-size > 1 runs on the CPU only so far: memsvc does not "
                             "yet give each GPU its own pool")
        self.plan = ShardPlan.of(ModelConfig.from_dir(self.model_dir), world, rank[0] if rank else 0)
        if rank is None:
            self.leader = tensor_parallel.Leader(self.plan, self.device, args, timeout, on_lost, group)
        else:
            tensor_parallel.join(self.plan, rank[1], self.device, timeout)

    def kv_geometry(self) -> KVGeometry:
        c = self.config
        heads = c.num_kv_heads if self.plan is None else self.plan.group_kv_heads
        return KVGeometry(num_layers=c.num_layers, num_kv_heads=heads, head_size=c.head_dim,
                          block_size=self.block_size, dtype=self.kv_dtype, window=c.kv_window or 0)

    def model_info(self) -> ModelInfo:
        return ModelInfo(
            name=self.name,
            max_model_len=self.config.max_model_len,
            vocab_size=self.config.vocab_size,
            eos_token_ids=list(self.config.eos_token_ids),
            chat_template=read_chat_template(self.model_dir),
            tokenizer_dir=self.model_dir,
            kv=self.kv_geometry(),
            max_num_seqs=DEFAULT_MAX_BATCH if self.device.type == "cuda" else 0,
        )

    def attach_pool(self, pool) -> None:
        """Use `pool` for the KV cache from now on (ValueError if it does not fit the model).
        Tensor parallel: the list of every rank's pool (pagedserve.executor.tp_pools.own_pool)."""
        holds = False
        if self.plan is not None:
            pool, holds = tp_pools.own_pool(pool, self.plan, self.leader, self.device)
        if pool.device.type != self.device.type:
            raise ValueError(f"KV pool is on {pool.device}, the model on {self.device}")
        if pool.shape[3] != self.block_size:
            raise ValueError(f"KV pool block size {pool.shape[3]} differs from {self.block_size}")
        if self.runner is None:
            self.runner = ModelRunner(self.model, self.model.config, pool, holds,
                                      kv_dtype=parse_dtype(self.kv_dtype))
            self.runner.guided = self.guided
        else:
            self.runner.attach_pool(pool, holds)

    def capture_graphs(self, progress: bool | None = None) -> int:
        """Capture the CUDA graphs of every bucket now, before any served step (decode steps:
        pagedserve.executor.cuda_graphs; the others: pagedserve.executor.piecewise_graphs); 0
        without graphs (a CPU, or none attached) and in a tensor-parallel group, whose ranks
        capture each bucket together on first use (a capture runs the group's collectives)."""
        if self.runner is None or self.leader is not None:
            return 0
        return self.runner.capture_graphs(progress)

    def graph_counts(self) -> tuple[int, int]:
        """(steps a CUDA graph ran, steps run eagerly beside graphs); (0, 0) without graphs."""
        return self.runner.graph_counts() if self.runner is not None else (0, 0)

    def detach_pool(self) -> None:
        """Hold no pool (the profiling step's scratch pool, pagedserve.executor.device_memory)."""
        self.runner = None

    def kv_budget(self, utilization: float) -> int:
        """The KV pool's bytes that `utilization` of the device leaves after the weights and a
        profiled step (pagedserve.executor.device_memory); 0 on a CPU (memsvc's default size).
        Run before the pool is attached: it profiles on a scratch pool and detaches it."""
        from pagedserve.executor import device_memory

        found = device_memory.measure(self)
        if found is None:
            return 0
        log.info("%s", found.describe(utilization))
        budget = found.budget(utilization)
        if not budget:
            log.warning("no room for a new KV pool at --gpu-memory-utilization %s; a pool memsvc "
                        "holds already serves as it is, and memsvc refuses to make one", utilization)
        return budget

    def execute(self, batch: StepBatch) -> StepOutputs:
        """Run one step: one output per sequence that reports (samples, returns prompt
        logprobs, or was left out: StepBatch.reports), in batch order."""
        if self.runner is None:
            raise RuntimeError("no KV pool attached: call attach_pool first")
        if self.leader is not None:
            return self.leader.lead("execute", batch, lambda: self.runner.execute(batch))
        if self.core_share is not None:
            self.core_share.adjust()
        return self.runner.execute(batch)

    def launch(self, batch: StepBatch) -> Launched:
        """`execute` for the step merger (pagedserve.executor.step_merger): the outputs may
        still be on their way from the device (ModelRunner.launch; a tensor-parallel group's
        are not)."""
        if self.runner is None or self.leader is not None:
            return launch_of(self.execute)(batch)
        if self.core_share is not None:
            self.core_share.adjust()
        start = time.perf_counter()
        outputs = self.runner.launch(batch)
        return Launched(outputs, time.perf_counter() - start)

    def logits(self, batch: StepBatch) -> torch.Tensor:
        """float32 logits [T, vocab] of every token of the step (ModelRunner.logits)."""
        if self.runner is None:
            raise RuntimeError("no KV pool attached: call attach_pool first")
        if self.leader is not None:
            return self.leader.lead("logits", batch, lambda: self.runner.logits(batch))
        return self.runner.logits(batch)

    def close(self) -> None:
        """Stop the group's other ranks (tensor parallel); nothing otherwise."""
        if self.leader is not None:
            self.leader.close()


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


def kv_cache_dtype_of(kv_cache_dtype: str, dtype: str, device: torch.device) -> str:
    """The KV pool's dtype for --kv-cache-dtype (ValueError naming the flag when refused)."""
    kv = dtype if kv_cache_dtype in (None, "auto") else kv_cache_dtype
    try:
        parse_dtype(kv)
    except ValueError as e:
        raise ValueError(f"--kv-cache-dtype: {e}") from None
    if kv != dtype and device.type != "cpu":
        raise ValueError(f"--kv-cache-dtype {kv} with --dtype {dtype}: on {device.type} the KV cache "
                         f"takes the model's dtype (--kv-cache-dtype auto or {dtype}); another dtype "
                         "runs on the CPU only")
    return kv


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
