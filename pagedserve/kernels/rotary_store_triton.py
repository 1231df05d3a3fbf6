"""Rotary embedding applied in the K/V store, as a Triton kernel for CUDA tensors (float32,
bfloat16, float16): the twin of pagedserve/kernels/rotary_store_cpu.py, with the same contract
and reference (pagedserve/kernels/fused_ref.rotary_store_kv_ref).

rotary_store_kv_(qk, v, cos, sin, k_cache, v_cache, slot_mapping) -> q: one program per token
rotates the Q heads of qk [T, q_heads + kv_heads, head_dim] in place and writes the rotated K
heads and v [T, kv_heads, head_dim] into their slots of the layer's caches (negative slots
skipped); qk's K heads are left unrotated. Returns the Q heads, a view of qk. Each product and
sum is rounded to qk's dtype where the torch path (apply_rotary, then store_kv) rounds, so a
16-bit model stores and attends to what it did before. A slot past the caches is skipped, not
raised (that would need a host sync; the CPU path raises): slots must lie within the pool.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.pool_share.device import on_device


@triton.jit
def _rotate(x1, x2, c, s, DT: tl.constexpr):
    """The half-split rotation, each product and sum rounded to DT as torch does in DT."""
    a = (x1 * c).to(DT).to(tl.float32)
    b = (x2 * s).to(DT).to(tl.float32)
    d = (x2 * c).to(DT).to(tl.float32)
    e = (x1 * s).to(DT).to(tl.float32)
    return (a - b).to(DT), (d + e).to(DT)


@triton.jit
def _rotary_store_kernel(
    qk_ptr, v_ptr, cos_ptr, sin_ptr, k_ptr, vc_ptr, slot_mapping_ptr, capacity,
    stride_qkt, stride_qkh, stride_vt, stride_vh, stride_cos, stride_sin,
    stride_kb, stride_ko, stride_kh, stride_vcb, stride_vco, stride_vch,
    Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr, Q_PAD: tl.constexpr,
    KV_PAD: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, HALF_PAD)[None, :]
    c = tl.load(cos_ptr + token * stride_cos + dims, mask=dims < HALF).to(tl.float32)
    s = tl.load(sin_ptr + token * stride_sin + dims, mask=dims < HALF).to(tl.float32)
    row = qk_ptr + token * stride_qkt

    heads = tl.arange(0, Q_PAD)[:, None]
    mask = (heads < Q_HEADS) & (dims < HALF)
    at = row + heads * stride_qkh + dims
    x1 = tl.load(at, mask=mask).to(tl.float32)
    x2 = tl.load(at + HALF, mask=mask).to(tl.float32)
    o1, o2 = _rotate(x1, x2, c, s, qk_ptr.dtype.element_ty)
    tl.store(at, o1, mask=mask)
    tl.store(at + HALF, o2, mask=mask)

    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if (slot < 0) | (slot >= capacity):
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, KV_PAD)[:, None]
    mask = (heads < KV_HEADS) & (dims < HALF)
    at = row + (Q_HEADS + heads) * stride_qkh + dims
    x1 = tl.load(at, mask=mask).to(tl.float32)
    x2 = tl.load(at + HALF, mask=mask).to(tl.float32)
    o1, o2 = _rotate(x1, x2, c, s, qk_ptr.dtype.element_ty)
    to = k_ptr + block * stride_kb + offset * stride_ko + heads * stride_kh + dims
    tl.store(to, o1.to(k_ptr.dtype.element_ty), mask=mask)
    tl.store(to + HALF, o2.to(k_ptr.dtype.element_ty), mask=mask)
    src = v_ptr + token * stride_vt + heads * stride_vh + dims
    to = vc_ptr + block * stride_vcb + offset * stride_vco + heads * stride_vch + dims
    tl.store(to, tl.load(src, mask=mask).to(vc_ptr.dtype.element_ty), mask=mask)
    tl.store(to + HALF, tl.load(src + HALF, mask=mask).to(vc_ptr.dtype.element_ty), mask=mask)


def rotary_store_kv_(qk, v, cos, sin, k_cache, v_cache, slot_mapping) -> torch.Tensor:
    """See the module docstring; cos/sin [T, head_dim/2] or [T, 1, head_dim/2] (unit stride
    along the last); caches [blocks, block_size, kv_heads, head_dim], unit stride along
    head_dim; slot_mapping integer [T]."""
    rows, heads, dim = qk.shape
    blocks, block_size, kv_heads = k_cache.shape[:3]
    q_heads = heads - kv_heads
    assert dim % 2 == 0 and k_cache.shape[3] == dim and v_cache.shape == k_cache.shape, \
        "caches: [blocks, block_size, kv_heads, head_dim] of qk's head_dim (even)"
    assert qk.stride(2) == 1 and v.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1, \
        "qk, v and the caches: unit stride along head_dim"
    assert tuple(v.shape) == (rows, kv_heads, dim), "v: [T, kv_heads, head_dim]"
    cos2, sin2 = cos.reshape(rows, -1), sin.reshape(rows, -1)
    assert cos2.shape == sin2.shape == (rows, dim // 2) and cos2.stride(1) == sin2.stride(1) == 1, \
        "cos, sin: [T, head_dim/2] with unit stride along it"
    assert slot_mapping.shape == (rows,) and not slot_mapping.is_floating_point(), "slot_mapping: integer [T]"
    if rows:
        with on_device(k_cache.device):  # launch on the pool's GPU, not the thread's current one
            _rotary_store_kernel[(rows,)](
                qk, v, cos2, sin2, k_cache, v_cache, slot_mapping, blocks * block_size,
                qk.stride(0), qk.stride(1), v.stride(0), v.stride(1), cos2.stride(0), sin2.stride(0),
                k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
                Q_HEADS=q_heads, KV_HEADS=kv_heads, HALF=dim // 2, Q_PAD=triton.next_power_of_2(q_heads),
                KV_PAD=triton.next_power_of_2(kv_heads), HALF_PAD=triton.next_power_of_2(dim // 2),
                BLOCK_SIZE=block_size, num_warps=4)
    return qk[:, :q_heads]
