"""The host swap space's memory: a block-major tensor shaped like the pool.

`[num_host_blocks, num_layers, 2, block_size, num_kv_heads, head_size]`, so a swap copies
one contiguous block per block (pagedserve.kernels.copy_blocks), not one piece per layer. Pinned when
the pool is on a GPU (allocated with the pool's GPU current, so no context appears on GPU 0);
plain memory otherwise. Its contents are undefined until a swap-out writes them (nothing
reads a host block before that).

Swap copies on a GPU (`swap_copy`) are asynchronous DMA on the pool device's current
stream: swap-out gathers the blocks on the GPU and copies each run of consecutive host ids
into pinned memory in one cudaMemcpyAsync; swap-in gathers host rows into a pinned staging
buffer, copies it up in one transfer and scatters it on the GPU. `finish_copies(pool)`
waits for the pool's device (only that one): memsvc calls it before Reserve answers, so
every copy-on-write and swap copy is complete before the executor, another process with
its own CUDA context and stream, can read the blocks.
"""
from __future__ import annotations

import time

import torch

from pagedserve.kernels import copy_blocks
from pagedserve.pool_share.device import on_device, synchronize
from pagedserve.wire.protocol import KVGeometry


def host_blocks_for(geometry: KVGeometry, swap_bytes: int) -> int:
    if swap_bytes < 0:
        raise ValueError(f"swap space must be >= 0 bytes, got {swap_bytes}")
    return swap_bytes // geometry.bytes_per_block


def allocate_host_pool(geometry: KVGeometry, num_blocks: int, pool: torch.Tensor) -> torch.Tensor:
    dtype = getattr(torch, geometry.dtype)
    with on_device(pool.device):  # pinning uses the current device's context
        return torch.empty(geometry.pool_shape(num_blocks), dtype=dtype, pin_memory=pool.is_cuda)


def _runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """(index in ids, first id, length) of each run of consecutive ids."""
    out = []
    i = 0
    while i < len(ids):
        j = i + 1
        while j < len(ids) and ids[j] == ids[j - 1] + 1:
            j += 1
        out.append((i, ids[i], j - i))
        i = j
    return out


def swap_copy(src: torch.Tensor, dst: torch.Tensor, src_ids: list[int], dst_ids: list[int]) -> None:
    """dst[dst_ids[i]] = src[src_ids[i]] between the GPU pool and the host swap space (either
    way; both on one device falls through to copy_blocks). Queued on the GPU's current
    stream, not waited for: see finish_copies."""
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source blocks for {len(dst_ids)} destinations")
    if not src_ids:
        return
    if src.is_cuda == dst.is_cuda:
        copy_blocks(src, dst, torch.tensor(src_ids, dtype=torch.long), torch.tensor(dst_ids, dtype=torch.long))
        return
    gpu = src.device if src.is_cuda else dst.device
    with on_device(gpu):
        if src.is_cuda:  # swap out: gather on the GPU, then one DMA per run of host ids
            ids = torch.tensor(src_ids, dtype=torch.long).to(gpu, non_blocking=True)
            blocks = torch.index_select(src, 0, ids)
            for i, first, n in _runs(list(dst_ids)):
                dst[first:first + n].copy_(blocks[i:i + n], non_blocking=True)
            # `blocks` is freed to the caching allocator, which reuses it only after this
            # stream's queued copies (same stream), so no record_stream is needed.
        else:  # swap in: host rows into pinned staging, one DMA up, scatter on the GPU
            staging = torch.empty((len(src_ids), *src.shape[1:]), dtype=src.dtype, pin_memory=True)
            for i, first, n in _runs(list(src_ids)):
                staging[i:i + n].copy_(src[first:first + n])
            blocks = staging.to(gpu, non_blocking=True)
            ids = torch.tensor(dst_ids, dtype=torch.long).to(gpu, non_blocking=True)
            dst.index_copy_(0, ids, blocks)
            # the pinned staging buffer may go out of scope now: torch's caching host
            # allocator records an event for a non_blocking copy out of pinned memory and
            # does not hand the buffer out again before that copy is done


def finish_copies(pool: torch.Tensor) -> None:
    """Wait until every copy queued on the pool's device is done (only that device)."""
    synchronize(pool.device)


def timed_copy(src: torch.Tensor, dst: torch.Tensor, src_ids: list[int], dst_ids: list[int]) -> float:
    """A swap (or same-device) copy, complete, and its wall seconds (the GPU involved
    synchronized on both ends)."""
    cuda = src.device if src.is_cuda else dst.device if dst.is_cuda else None
    synchronize(cuda) if cuda is not None else None
    start = time.perf_counter()
    swap_copy(src, dst, src_ids, dst_ids)
    if cuda is not None:
        synchronize(cuda)
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
