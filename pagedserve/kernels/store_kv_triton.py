"""Writing new K/V into their cache slots, as a Triton kernel: one program per token."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.pool_share.device import on_device


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_ptr, v_ptr, slot_mapping_ptr,
    stride_keyt, stride_keyh, stride_keyd,
    stride_valuet, stride_valueh, stride_valued,
    stride_kb, stride_ko, stride_kh, stride_kd,
    stride_vb, stride_vo, stride_vh, stride_vd,
    NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HEAD_PAD)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_SIZE)
    key = tl.load(key_ptr + token * stride_keyt + heads * stride_keyh + dims * stride_keyd, mask=mask)
    value = tl.load(value_ptr + token * stride_valuet + heads * stride_valueh + dims * stride_valued, mask=mask)
    tl.store(k_ptr + block * stride_kb + offset * stride_ko + heads * stride_kh + dims * stride_kd,
             key.to(k_ptr.dtype.element_ty), mask=mask)
    tl.store(v_ptr + block * stride_vb + offset * stride_vo + heads * stride_vh + dims * stride_vd,
             value.to(v_ptr.dtype.element_ty), mask=mask)


def store_kv_triton(key, value, k_cache, v_cache, slot_mapping):
    num_blocks, block_size, num_kv_heads, head_size = k_cache.shape
    assert v_cache.shape == k_cache.shape, "k_cache and v_cache: [num_blocks, block_size, num_kv_heads, head_size]"
    assert key.shape == value.shape and key.shape[1:] == (num_kv_heads, head_size), "key, value: [T, kv_heads, head]"
    assert slot_mapping.shape == key.shape[:1] and not slot_mapping.is_floating_point()
    if key.shape[0] == 0:
        return
    with on_device(k_cache.device):  # launch on the pool's GPU, not the thread's current one
        _launch(key, value, k_cache, v_cache, slot_mapping)


def _launch(key, value, k_cache, v_cache, slot_mapping):
    num_blocks, block_size, num_kv_heads, head_size = k_cache.shape
    _store_kv_kernel[(key.shape[0],)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads, HEAD_SIZE=head_size,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads), HEAD_PAD=triton.next_power_of_2(head_size),
        BLOCK_SIZE=block_size,
    )
