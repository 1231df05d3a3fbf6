"""The block copies a Reserve decided, performed on the pool tensors before it answers.

Copies come as (kind, src, dst) on block ids, in the order decided (a block a swap-out
frees may be the target of a later copy): "cow" pool -> pool, "out" pool -> swap space,
"in" swap space -> pool, "offload" pool -> host tier, "restore" host tier -> pool
(pagedserve.memsvc.step_planner.COPY_KINDS). Each run of one kind is one copy, applied to
every rank's pools (the same block ids on each); swaps are timed for the cost model; all
are complete before Reserve answers, since the executor reads the pool from another
context (pagedserve.memsvc.host_pool). docs/ARCHITECTURE.md, "Tensor parallelism".
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pagedserve.kernels import copy_blocks
from pagedserve.memsvc.host_pool import finish_copies, timed_copy

if TYPE_CHECKING:
    from pagedserve.memsvc.memory_manager import MemoryManager


def perform_copies(mm: MemoryManager, copies: list[tuple[str, int, int]]) -> None:
    """Perform the planner's copies in order, one copy_blocks per run of one kind; time
    the swaps for the cost model."""
    i = 0
    while i < len(copies):
        kind = copies[i][0]
        j = i
        while j < len(copies) and copies[j][0] == kind:
            j += 1
        src = [c[1] for c in copies[i:j]]
        dst = [c[2] for c in copies[i:j]]
        if kind == "cow":  # every rank's pool: the same block ids on each
            for pool in mm.pools:
                copy_blocks(pool, pool, torch.tensor(src, dtype=torch.long),
                            torch.tensor(dst, dtype=torch.long))
        else:
            hosts = mm.tier_pools if kind in ("offload", "restore") else mm.host_pools
            seconds = 0.0
            for pool, host in zip(mm.pools, hosts):
                pair = (pool, host) if kind in ("out", "offload") else (host, pool)
                seconds += timed_copy(*pair, src, dst)
            mm.policy.costs.observe_copy(j - i, seconds)
        i = j
    if copies:  # complete before Reserve answers: the executor reads from another context
        for pool in mm.pools:
            finish_copies(pool)
