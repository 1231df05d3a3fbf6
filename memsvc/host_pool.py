"""The host swap space's memory: a block-major tensor shaped like the pool.

`[num_host_blocks, num_layers, 2, block_size, num_kv_heads, head_size]`, so a swap copies
one contiguous block per block (kernels.copy_blocks), not one piece per layer. Pinned when
the pool is on a GPU (the copies can use DMA); plain memory otherwise. Its contents are
undefined until a swap-out writes them (nothing reads a host block before that).
"""
from __future__ import annotations

import time

import torch

from kernels import copy_blocks
from wire.protocol import KVGeometry


def host_blocks_for(geometry: KVGeometry, swap_bytes: int) -> int:
    if swap_bytes < 0:
        raise ValueError(f"swap space must be >= 0 bytes, got {swap_bytes}")
    return swap_bytes // geometry.bytes_per_block


def allocate_host_pool(geometry: KVGeometry, num_blocks: int, pool: torch.Tensor) -> torch.Tensor:
    dtype = getattr(torch, geometry.dtype)
    return torch.empty(geometry.pool_shape(num_blocks), dtype=dtype, pin_memory=pool.is_cuda)


def timed_copy(src: torch.Tensor, dst: torch.Tensor, src_ids: list[int], dst_ids: list[int]) -> float:
    """copy_blocks, and its wall seconds (the device synchronized on both ends)."""
    cuda = src.is_cuda or dst.is_cuda
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    copy_blocks(src, dst, torch.tensor(src_ids, dtype=torch.long), torch.tensor(dst_ids, dtype=torch.long))
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def measure_block_copy(pool: torch.Tensor, host: torch.Tensor, num_blocks: int = 8,
                       repeats: int = 3) -> float | None:
    """Seconds per block, one way: the best of `repeats` rounds of copying the first
    `num_blocks` pool blocks out and back (their contents do not change). None without room."""
    n = min(num_blocks, pool.shape[0], host.shape[0])
    if n < 1:
        return None
    ids = list(range(n))
    best = float("inf")
    for _ in range(repeats):
        seconds = timed_copy(pool, host, ids, ids) + timed_copy(host, pool, ids, ids)
        best = min(best, seconds / (2 * n))
    return best
