"""An executor registers with memsvc: the pool, the host swap space and the prefix cache's
host tier are sized and allocated once, for the first geometry, and given to every later
executor (a restart, a replica) of the same geometry, device and ranks; another is a
ValueError.

A tensor-parallel group registers with `ranks` > 1: memsvc holds one pool per rank (and
one swap space and host tier per rank) of the same block geometry, 1/ranks of the KV heads
each (pagedserve.memsvc.kv_pool.rank_geometry); every decision is made once, on block ids,
and every block copy is applied to every rank's pools (pagedserve.memsvc.pool_copies);
capacity and budgets count all ranks' bytes. A rank that holds its own pool (`holds_pool`:
a rank on another node) gets none here, and memsvc preempts by recompute alone and keeps
no host tier; the group registering again means those pools are new and empty, so
everything memsvc held is dropped under a new `pool_epoch` (`new_epoch`;
pagedserve.memsvc.held_pools).

With `MemoryConfig.shared`, the pool lives where another process can map it: a POSIX
shared-memory segment on the CPU (`shm_pool`), a CUDA IPC allocation on a GPU named by
UUID (`cuda_ipc`). Block-copy time is measured once the host memory is allocated, for the
cost model. docs/ARCHITECTURE.md, "The pool and how it is shared".
"""
from __future__ import annotations

import functools
import uuid
from typing import TYPE_CHECKING

import torch

from pagedserve.memsvc import make_allocator
from pagedserve.memsvc.config import CPU_KV_GIB, GIB
from pagedserve.memsvc.held_pools import check_holds, held_text
from pagedserve.memsvc.host_pool import allocate_host_pool, host_blocks_for, measure_block_copy
from pagedserve.memsvc.kv_pool import allocate_pool, num_blocks_for_budget, rank_geometry
from pagedserve.memsvc.offload_decisions import offload_pays
from pagedserve.memsvc.preemption_policy import PreemptionPolicy
from pagedserve.memsvc.sessions import Sessions
from pagedserve.memsvc.step_planner import StepPlanner
from pagedserve.memsvc.step_stamps import StepStamps
from pagedserve.wire.protocol import KVGeometry

if TYPE_CHECKING:
    from pagedserve.memsvc.memory_manager import MemoryManager


def register(mm: MemoryManager, geometry: KVGeometry, budget_bytes: int = 0,
             device: str | None = None, max_model_len: int = 0, ranks: int = 1,
             holds_pool: list[bool] | None = None):
    """Allocate the pool for this geometry (once) and return it; with `ranks` > 1 (a
    tensor-parallel group, `geometry` holding all its KV heads) the list of every rank's
    pool, rank r's at r (None for a rank that `holds_pool` itself: pagedserve.memsvc.held_pools).

    A later executor (a restart, a replica) with the same geometry, device and ranks gets
    the same pool; a different one is a ValueError. Size: `config.num_blocks`, else
    `config.kv_tokens`, else `config.kv_memory`, else `budget_bytes` (the executor's, from
    its --gpu-memory-utilization; none on a GPU is a ValueError), else CPU_KV_GIB; bytes
    count all ranks.
    `max_model_len` 0 means `config.max_model_len`.
    """
    device = device or mm.config.device
    holds = check_holds(holds_pool, ranks, mm.config)
    if mm.pool is not None:
        if (geometry != mm.geometry or device != mm.pool_device or ranks != mm.ranks
                or holds != mm.holds_pool):
            raise ValueError(f"the pool exists for {mm.geometry} on {mm.pool_device} "
                             f"({mm.ranks} ranks{held_text(mm.holds_pool)}); this executor "
                             f"sent {geometry} on {device} ({ranks} ranks{held_text(holds)})")
        if any(holds):  # the group restarted: its ranks' own pools are new and empty
            new_epoch(mm)
        return rank_pools(mm)
    per_rank = rank_geometry(geometry, ranks)
    cfg = mm.config
    mm.holds_pool = holds
    if any(holds):
        mm.policy = PreemptionPolicy("recompute")
    num_blocks = cfg.num_blocks
    if num_blocks is None and cfg.kv_tokens is not None:
        num_blocks = cfg.kv_tokens // geometry.block_size
        if num_blocks < 1:
            raise ValueError(f"kv_tokens={cfg.kv_tokens} holds no block of {geometry.block_size} tokens")
    if num_blocks is None:
        if cfg.kv_memory is None and not budget_bytes and device != "cpu":
            raise ValueError(f"the executor found no memory left on {device} for the KV pool (its "
                             "log says what the weights and a step take): lower what else runs "
                             "there, raise the executor's --gpu-memory-utilization, or size the "
                             "pool with memsvc's --kv-memory or --kv-tokens")
        if cfg.kv_memory is not None or not budget_bytes:
            budget_bytes = int((cfg.kv_memory or CPU_KV_GIB) * GIB)
        num_blocks = num_blocks_for_budget(geometry, budget_bytes)
    mm.pools = [_allocate(mm, per_rank, num_blocks, device, r) for r in range(ranks) if not holds[r]]
    mm.pool, mm.ranks = mm.pools[0], ranks
    mm.geometry, mm.pool_device = geometry, device
    num_host = 0
    if cfg.policy == "paged" and mm.policy.mode != "recompute":
        num_host = cfg.num_host_blocks
        if num_host is None:
            num_host = host_blocks_for(geometry, int(cfg.swap_space * GIB))
    num_tier = 0
    if cfg.policy == "paged" and cfg.prefix_caching and not any(holds):
        num_tier = cfg.num_offload_blocks
        if num_tier is None:
            num_tier = host_blocks_for(geometry, int(cfg.kv_offload * GIB))
    mm.new_allocator = functools.partial(
        make_allocator, cfg.policy, num_blocks, geometry.block_size,
        max_model_len=max_model_len or cfg.max_model_len, enable_prefix_caching=cfg.prefix_caching,
        num_host_blocks=num_host, window=geometry.window or None, num_offload_blocks=num_tier)
    mm.allocator = mm.new_allocator()
    if num_host:
        mm.host_pools = [allocate_host_pool(per_rank, num_host, p) for p in mm.pools]
        mm.host_pool = mm.host_pools[0]
    if num_tier:
        mm.tier_pools = [allocate_host_pool(per_rank, num_tier, p) for p in mm.pools]
        for tier in mm.tier_pools:
            tier.zero_()  # its pages faulted in now, not by offloads in Reserve
        mm.tier_pool = mm.tier_pools[0]
        mm.allocator.offload.pays = functools.partial(offload_pays, mm)
    host = mm.host_pool if mm.host_pool is not None else mm.tier_pool
    if host is not None:
        seconds = measure_block_copy(mm.pool, host)
        if seconds is not None:  # a block copy moves every rank's part
            mm.policy.costs.observe_copy(1, seconds * ranks)
    mm.planner = StepPlanner(mm.allocator, mm.policy, int(cfg.watermark * num_blocks))
    return rank_pools(mm)


def rank_pools(mm: MemoryManager):
    """rank 0's pool alone, or every rank's (None where the rank holds its own)."""
    if mm.ranks == 1:
        return mm.pool
    own = iter(mm.pools)
    return [None if held else next(own) for held in mm.holds_pool]


def new_epoch(mm: MemoryManager) -> None:
    """Forget every sequence, cached block and session under a new pool epoch, as a new
    memsvc process would, keeping the pools memsvc holds (their contents go unread)."""
    mm.pool_epoch = uuid.uuid4().hex
    mm.allocator = mm.new_allocator()
    mm.planner = StepPlanner(mm.allocator, mm.policy, mm.planner.watermark_blocks)
    mm.sessions = Sessions(mm.config.session_lease)
    mm.last_stamps = {}
    mm.stamps = StepStamps()


def _allocate(mm: MemoryManager, geometry: KVGeometry, num_blocks: int, device: str,
              rank: int = 0) -> torch.Tensor:
    from pagedserve.pool_share.cuda_ipc import allocate_cuda_pool, is_gpu_uuid

    if not mm.config.shared:
        return allocate_pool(geometry, num_blocks, device)
    if is_gpu_uuid(device) and rank > 0:
        raise ValueError("rank_devices: one pool per GPU for a tensor-parallel group is not "
                         "built yet (only CPU ranks, each with a shared-memory pool)")
    if is_gpu_uuid(device):
        pool, mm.cuda_handle = allocate_cuda_pool(geometry, num_blocks, device)
        return pool
    if device != "cpu":
        raise ValueError(f"a shared pool lives on 'cpu' or a GPU named by UUID, not {device!r}")
    from pagedserve.pool_share.shm_pool import ShmPool

    name = mm.config.shm_name
    if name and rank:
        name = f"{name}-rank{rank}"
    shm = ShmPool(geometry, num_blocks, name)
    mm.shms.append(shm)
    mm.shm = mm.shms[0]
    return shm.tensor
