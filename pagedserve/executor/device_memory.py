"""How many bytes of a GPU the KV pool may take (`--gpu-memory-utilization`).

With the weights on the device, the executor runs one profiling step of `PROFILE_TOKENS`
prompt tokens over `PROFILE_SEQS` sequences (each samples) on a scratch pool, and reads the
allocator's peak. The pool's budget is utilization x the device's memory, less what is in
use now (weights, this process's context, other processes) and less that step's peak and a
reserve for CUDA graphs. The executor sends the budget to memsvc when it registers; memsvc
sizes the pool from it unless `--kv-memory` or `--kv-tokens` is given (docs/ARCHITECTURE.md,
"The pool and how it is shared"). On a CPU there is no budget: memsvc's default size.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.step.whole_seqs import Seq, batch_of

PROFILE_TOKENS = 8192  # the largest step the budget leaves room for (the gateway's default: 2,048)
PROFILE_SEQS = 256  # rows sampled in it (the largest CUDA graph bucket, pagedserve.executor.cuda_graphs)
GRAPH_RESERVE = 1 << 30  # bytes kept for the CUDA graphs' private pools, captured after the pool


@dataclass
class DeviceMemory:
    """One device's memory as the executor found it before the pool, in bytes."""

    total: int
    in_use: int  # by everything on the device: weights, contexts, other processes
    step_peak: int  # a profiling step's activations, above what it started with
    graph_reserve: int

    def budget(self, utilization: float) -> int:
        """The pool's bytes at this utilization: 0 where nothing is left (a pool memsvc holds
        already, after a restart of this executor, takes the room the profile finds missing)."""
        if not 0 < utilization <= 1:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
        return max(0, int(self.total * utilization) - self.in_use - self.step_peak - self.graph_reserve)

    def describe(self, utilization: float) -> str:
        gib = 1 << 30
        return (f"KV pool budget {self.budget(utilization) / gib:.2f} GiB of {utilization:g} x "
                f"{self.total / gib:.1f} GiB - {self.in_use / gib:.2f} in use - "
                f"{self.step_peak / gib:.2f} step peak - {self.graph_reserve / gib:.2f} graphs")


def profile_step(executor, tokens: int = PROFILE_TOKENS, seqs: int = PROFILE_SEQS) -> int:
    """Run one step of `tokens` prompt tokens over `seqs` sequences on a scratch pool just large
    enough, then detach it (the executor holds no pool afterwards); the scratch pool's bytes."""
    geometry = executor.kv_geometry()
    bs = geometry.block_size
    seqs = max(1, min(seqs, tokens))
    each = [tokens // seqs + (i < tokens % seqs) for i in range(seqs)]
    blocks = [-(-n // bs) for n in each]
    pool = torch.zeros(geometry.pool_shape(sum(blocks)), dtype=getattr(torch, geometry.dtype),
                       device=executor.device)
    vocab = executor.config.vocab_size
    steps, first = [], 0
    for i, (n, b) in enumerate(zip(each, blocks)):
        prompt = [(i * 31 + j) % vocab for j in range(n)]
        steps.append(Seq(f"profile-{i}", prompt, 0, list(range(first, first + b)), prompt=prompt))
        first += b
    executor.attach_pool(pool)
    try:
        executor.execute(batch_of(steps, bs))
    finally:
        executor.detach_pool()
    return pool.numel() * pool.element_size()


def measure(executor, tokens: int = PROFILE_TOKENS, seqs: int = PROFILE_SEQS) -> DeviceMemory | None:
    """The device's memory around one profiling step; None on a CPU."""
    device = executor.device
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    start = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    scratch = profile_step(executor, tokens, seqs)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - start - scratch  # the real pool replaces it
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(total=total, in_use=total - free, step_peak=max(peak, 0),
                        graph_reserve=GRAPH_RESERVE)
