"""Whole-block copies within or between device pools, as a Triton kernel.

One program copies CHUNK elements of one block; a block is one contiguous row of the pool.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.pool_share.device import on_device


@triton.jit
def _copy_blocks_kernel(src_ptr, dst_ptr, src_ids_ptr, dst_ids_ptr, row_size, stride_srcb, stride_dstb,
                        CHUNK: tl.constexpr):
    pair = tl.program_id(0)
    chunk = tl.program_id(1)
    src = tl.load(src_ids_ptr + pair).to(tl.int64)
    dst = tl.load(dst_ids_ptr + pair).to(tl.int64)
    offsets = chunk.to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    mask = offsets < row_size
    row = tl.load(src_ptr + src * stride_srcb + offsets, mask=mask)
    tl.store(dst_ptr + dst * stride_dstb + offsets, row, mask=mask)


def copy_blocks_triton(src_pool, dst_pool, src_ids, dst_ids, chunk=4096):
    assert src_pool.shape[1:] == dst_pool.shape[1:] and src_pool.dtype == dst_pool.dtype
    assert src_pool.device == dst_pool.device, "host<->device copies go through the torch path"
    assert src_pool[0].is_contiguous() and dst_pool[0].is_contiguous(), "pools: [num_blocks, ...], rows contiguous"
    src_ids = torch.as_tensor(src_ids, dtype=torch.long).to(src_pool.device, non_blocking=True)
    dst_ids = torch.as_tensor(dst_ids, dtype=torch.long).to(dst_pool.device, non_blocking=True)
    assert src_ids.shape == dst_ids.shape and src_ids.dim() == 1
    if src_ids.numel() == 0:
        return
    row_size = src_pool[0].numel()
    grid = (src_ids.numel(), triton.cdiv(row_size, chunk))
    with on_device(src_pool.device):  # launch on the pool's GPU, not the thread's current one
        _copy_blocks_kernel[grid](src_pool, dst_pool, src_ids, dst_ids, row_size, src_pool.stride(0),
                                  dst_pool.stride(0), CHUNK=chunk)
