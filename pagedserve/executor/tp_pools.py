"""Each rank of a tensor-parallel group maps only its own KV pool (docs/ARCHITECTURE.md,
"Tensor parallelism").

memsvc holds one pool per rank with the same block geometry (each rank's KV heads), so a
block id names the same block on every rank and memsvc applies every block copy to every
rank's pool. Rank 0 gets the list (memsvc's registration answer), sends every rank the
(shared-memory name, shape, dtype) of each pool, and each rank maps its own (`own_pool`).
A rank on another node (GroupLayout.holds_own_pool) gets the name "": it allocates a pool
of that shape itself, and applies the step's copies to it (StepBatch.copies;
pagedserve.memsvc.held_pools).
"""
from __future__ import annotations

import os

import torch

from pagedserve.executor.sharding import ShardPlan


def own_pool(pools, plan: ShardPlan, leader, device: torch.device | None = None
             ) -> tuple[torch.Tensor, bool]:
    """This rank's KV pool from the group's list (rank r's at r: a mapped tensor or a
    (shared-memory name, shape, dtype) spec that this rank maps, or allocates on `device`
    when the name is ""), and whether this rank holds it itself; rank 0 (`leader`) first
    sends the specs to every rank."""
    if isinstance(pools, torch.Tensor) or len(pools) != plan.world:
        got = "one pool" if isinstance(pools, torch.Tensor) else f"{len(pools)} pools"
        raise ValueError(f"a tensor-parallel group of {plan.world} ranks needs one KV pool per "
                         f"rank (memsvc registration with {plan.world} rank_devices); got {got}")
    if leader is not None:
        leader.lead("attach", [pool_spec(p) for p in pools])
    mine = pools[plan.rank]
    holds = not isinstance(mine, torch.Tensor) and mine[0] == ""
    if holds:
        _, shape, dtype = mine
        mine = torch.zeros(shape, dtype=getattr(torch, dtype), device=device)
    elif not isinstance(mine, torch.Tensor):
        from pagedserve.pool_share.shm_pool import attach_shm_pool

        try:
            mine = attach_shm_pool(*mine)
        except FileNotFoundError:
            raise RuntimeError(
                f"rank {plan.rank} cannot map its KV pool segment {mine[0]!r}: memsvc's pools live "
                f"in the shared memory of memsvc's host, which a rank on another node cannot map: "
                f"run ranks of other nodes as nodes (--tensor-parallel-nodes, or LeaderWorkerSet), "
                f"which hold their own pools (docs/ARCHITECTURE.md, \"Tensor parallelism\")") from None
    if mine.shape[4] != plan.kv_heads:
        raise ValueError(f"rank {plan.rank}'s KV pool has {mine.shape[4]} KV heads; its shard "
                         f"holds {plan.kv_heads}")
    return mine, holds


def pool_spec(pool) -> tuple[str, list[int], str]:
    """(shared-memory name, shape, dtype) of a rank's CPU pool, for the rank that maps it."""
    if not isinstance(pool, torch.Tensor):
        name, shape, dtype = pool
        return name, list(shape), dtype
    path = pool.untyped_storage().filename if pool.device.type == "cpu" else None
    if not path or not path.startswith("/dev/shm/"):
        raise ValueError("tensor parallel needs each rank's KV pool in shared memory (memsvc's "
                         "shared CPU pools), so that the rank can map it")
    return os.path.basename(path), list(pool.shape), str(pool.dtype).removeprefix("torch.")
