"""Kernels over the paged KV pool: attention, K/V stores, block copies.

The pool is one block-major tensor `[num_blocks, num_layers, 2, block_size, num_kv_heads,
head_size]`. A layer's K cache is the strided view `pool[:, layer, 0]` and its V cache
`pool[:, layer, 1]`, each `[num_blocks, block_size, num_kv_heads, head_size]` and not
contiguous; the kernels take these views as they are. Slot `s` is block `s // block_size`,
offset `s % block_size`.

Every op dispatches on the device of its tensors: CUDA tensors go to a Triton kernel
(when triton is importable), launched with their GPU current, anything else to the CPU path (pagedserve/kernels/paged_cpu.py:
decode attention in place over the pool in a small C++ kernel, the rest in torch), which
falls back to the torch reference implementations (the *_ref modules, the reference the
Triton and CPU kernels are tested against) for what it does not cover.

paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out=None)
    q: `[T, num_heads, head_size]`, the query tokens of all sequences packed in batch order.
    block_tables: int32 `[B, max_blocks]`; entries past `ceil(seq_lens[b] / block_size)` are
      padding (any value, -1 included) and are ignored.
    seq_lens: int32 `[B]`, context length including this step's tokens, whose K/V are
      already in the cache (see store_kv).
    query_start_loc: int32 `[B + 1]`, cumulative; sequence b's queries are
      `q[query_start_loc[b]:query_start_loc[b + 1]]` and sit at its last positions
      (`seq_lens[b] - q_len ... seq_lens[b] - 1`). q_len 1 is a decode, more a prefill
      chunk, 0 a sequence with nothing to compute. Causal: position p sees 0..p.
    num_heads must be a multiple of num_kv_heads (head h reads kv head
      `h // (num_heads // num_kv_heads)`). float32, bfloat16 or float16, softmax in float32.
    window (optional int): sliding-window attention, position p sees p - window + 1 .. p only;
      blocks wholly before every query's window are never read (their table entries may be
      stale). softcap (optional float): scores s -> softcap * tanh(s / softcap) (Gemma 2).
    Returns `[T, num_heads, head_size]` in q's dtype, written into `out` when given.
    Cache slots past a sequence's length (the tail of its last block, blocks named by padding
    entries) may hold anything, NaN included: no path lets them reach the output.

store_kv(key, value, k_cache, v_cache, slot_mapping)
    key, value: `[T, num_kv_heads, head_size]`; slot_mapping: integer `[T]`. Writes token t
    into slot `slot_mapping[t]` of both caches; negative slots are padding and skipped.
    Slots must be distinct.

copy_blocks(src_pool, dst_pool, src_ids, dst_ids)
    Pools are whole block-major pools `[num_blocks, ...]` (one block is one row);
    `dst_pool[dst_ids[i]] = src_pool[src_ids[i]]` for every i, one copy per block. The
    same pool (copy-on-write) or two pools, possibly on different devices (swap). dst ids
    must be distinct, and within one pool no block may be both a source and a destination.
    Ids are integer tensors or sequences.
"""
from __future__ import annotations

import importlib.util

from pagedserve.kernels.copy_blocks_ref import copy_blocks_ref
from pagedserve.kernels.paged_cpu import paged_attention_cpu, store_kv_cpu

__all__ = ["paged_attention", "store_kv", "copy_blocks"]

_HAS_TRITON = importlib.util.find_spec("triton") is not None


def _use_triton(*tensors) -> bool:
    return _HAS_TRITON and all(t.is_cuda for t in tensors)


def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out=None,
                    window=None, softcap=None):
    if _use_triton(q, k_cache, v_cache):
        from pagedserve.kernels.paged_attention_triton import paged_attention_triton

        return paged_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out,
                                      window=window, softcap=softcap)
    return paged_attention_cpu(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out,
                               window=window, softcap=softcap)


def store_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    if _use_triton(key, value, k_cache, v_cache):
        from pagedserve.kernels.store_kv_triton import store_kv_triton

        return store_kv_triton(key, value, k_cache, v_cache, slot_mapping)
    store_kv_cpu(key, value, k_cache, v_cache, slot_mapping)


def copy_blocks(src_pool, dst_pool, src_ids, dst_ids) -> None:
    if _use_triton(src_pool, dst_pool) and src_pool.device == dst_pool.device:
        from pagedserve.kernels.copy_blocks_triton import copy_blocks_triton

        return copy_blocks_triton(src_pool, dst_pool, src_ids, dst_ids)
    copy_blocks_ref(src_pool, dst_pool, src_ids, dst_ids)
