"""The KV pool tensor: block-major [num_blocks, num_layers, 2, block_size, num_kv_heads, head_size]."""
from __future__ import annotations

import torch

from wire.protocol import KVGeometry


def num_blocks_for_budget(geometry: KVGeometry, budget_bytes: int) -> int:
    """How many blocks of this geometry fit in `budget_bytes`."""
    n = budget_bytes // geometry.bytes_per_block
    if n < 1:
        raise ValueError(
            f"a KV budget of {budget_bytes} bytes holds no block of {geometry.bytes_per_block} bytes"
        )
    return int(n)


def allocate_pool(geometry: KVGeometry, num_blocks: int, device: str = "cpu") -> torch.Tensor:
    """A zeroed pool in process memory (the in-process engine; services use shared memory)."""
    dtype = getattr(torch, geometry.dtype)
    return torch.zeros(geometry.pool_shape(num_blocks), dtype=dtype, device=device)
