"""Paged attention as a Triton kernel: one program per (tile of one sequence's queries, kv head).

A program's rows are BLOCK_Q query tokens x GROUP query heads sharing one kv head, padded
to BLOCK_M >= 16 rows for tl.dot. It walks the sequence's context in tiles of TILE
positions, looking up each position's block in the block table, with an online softmax in
float32. Tiles are upcast to float32 after loading; the dots run in IEEE float32 for float32
caches and in TF32 for 16-bit ones (exact for their inputs, float32 accumulation; the
interpreter also miscomputes bfloat16 dots). Programs are numbered as in `query_start_loc[b] // BLOCK_Q + b`, so the grid
size is known on the host without reading any device tensor.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    scale, num_seqs,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ko, stride_kh, stride_kd,
    stride_vb, stride_vo, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_btb, stride_btn,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    program = tl.program_id(0)
    kv_head = tl.program_id(1)

    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= program:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    seq_start = tl.load(query_start_loc_ptr + seq)
    seq_end = tl.load(query_start_loc_ptr + seq + 1)
    tile_start = seq_start + (program - (seq_start // BLOCK_Q + seq)) * BLOCK_Q
    if tile_start >= seq_end:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_start = seq_len - (seq_end - seq_start)

    rows = tl.arange(0, BLOCK_M)
    tokens = tile_start + rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    row_ok = (rows // GROUP < BLOCK_Q) & (tokens < seq_end)
    row_pos = context_start + tokens - seq_start
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_SIZE

    q = tl.load(
        q_ptr + tokens[:, None].to(tl.int64) * stride_qt + heads[:, None] * stride_qh + dims[None, :] * stride_qd,
        mask=row_ok[:, None] & dim_ok[None, :], other=0.0,
    ).to(tl.float32)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)

    last_pos = context_start + tl.minimum(tile_start + BLOCK_Q, seq_end) - 1 - seq_start
    for tile in range(0, last_pos // TILE + 1):
        positions = tile * TILE + tl.arange(0, TILE)
        kv_ok = positions <= last_pos
        blocks = tl.load(block_tables_ptr + seq * stride_btb + (positions // BLOCK_SIZE) * stride_btn,
                         mask=kv_ok, other=0).to(tl.int64)
        offsets = positions % BLOCK_SIZE
        kv_mask = kv_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_ptr + blocks[:, None] * stride_kb + offsets[:, None] * stride_ko + kv_head * stride_kh
                    + dims[None, :] * stride_kd, mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + blocks[:, None] * stride_vb + offsets[:, None] * stride_vo + kv_head * stride_vh
                    + dims[None, :] * stride_vd, mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        s = tl.where(kv_ok[None, :] & (positions[None, :] <= row_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m = m_new

    result = acc / l[:, None]
    tl.store(
        out_ptr + tokens[:, None].to(tl.int64) * stride_ot + heads[:, None] * stride_oh + dims[None, :] * stride_od,
        result.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :],
    )


def paged_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out=None, tile=32):
    num_blocks, block_size, num_kv_heads, head_size = k_cache.shape
    num_tokens, num_heads, _ = q.shape
    assert v_cache.shape == k_cache.shape, "k_cache and v_cache: [num_blocks, block_size, num_kv_heads, head_size]"
    assert q.shape[2] == head_size and num_heads % num_kv_heads == 0, "q: [T, num_heads, head_size], GQA"
    assert q.dtype == k_cache.dtype == v_cache.dtype
    assert block_tables.dim() == 2 and block_tables.dtype == torch.int32
    assert seq_lens.dtype == torch.int32 and query_start_loc.dtype == torch.int32
    assert query_start_loc.shape[0] == seq_lens.shape[0] + 1 == block_tables.shape[0] + 1
    assert tile >= 16 and tile & (tile - 1) == 0
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape
    if num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    block_m = max(16, triton.next_power_of_2(group))
    block_q = block_m // group
    num_seqs = seq_lens.shape[0]
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc,
        scale, num_seqs,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        out.stride(0), out.stride(1), out.stride(2),
        block_tables.stride(0), block_tables.stride(1),
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m,
        HEAD_SIZE=head_size, HEAD_PAD=max(16, triton.next_power_of_2(head_size)), BLOCK_SIZE=block_size, TILE=tile,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return out
