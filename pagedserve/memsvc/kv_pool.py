"""The KV pool tensor: block-major [num_blocks, num_layers, 2, block_size, num_kv_heads, head_size].

A tensor-parallel group registers the geometry of all its ranks (its KV heads summed over
the ranks) and gets one pool per rank with `rank_geometry`: the same blocks, layers and
block size, 1/ranks of the KV heads, so a block id names the same block on every rank
(docs/ARCHITECTURE.md, "Tensor parallelism"). Sizing by a byte budget always uses the
group's geometry: the budget and the capacity count every rank's KV bytes.
"""
from __future__ import annotations

import dataclasses

import torch

from pagedserve.wire.protocol import KVGeometry


def num_blocks_for_budget(geometry: KVGeometry, budget_bytes: int) -> int:
    """How many blocks of this geometry fit in `budget_bytes`."""
    n = budget_bytes // geometry.bytes_per_block
    if n < 1:
        raise ValueError(
            f"a KV budget of {budget_bytes} bytes holds no block of {geometry.bytes_per_block} bytes"
        )
    return int(n)


def rank_geometry(geometry: KVGeometry, ranks: int) -> KVGeometry:
    """One rank's pool geometry of a group of `ranks` whose KV heads are `geometry`'s."""
    if ranks < 1:
        raise ValueError(f"rank_devices: a group needs at least one rank, got {ranks}")
    if geometry.num_kv_heads % ranks:
        raise ValueError(f"geometry.num_kv_heads ({geometry.num_kv_heads}) is not a multiple of the "
                         f"{ranks} ranks in rank_devices: each rank's pool holds an equal share")
    return dataclasses.replace(geometry, num_kv_heads=geometry.num_kv_heads // ranks)


def allocate_pool(geometry: KVGeometry, num_blocks: int, device: str = "cpu") -> torch.Tensor:
    """A zeroed pool in process memory (the in-process engine; services use shared memory)."""
    dtype = getattr(torch, geometry.dtype)
    return torch.zeros(geometry.pool_shape(num_blocks), dtype=dtype, device=device)
