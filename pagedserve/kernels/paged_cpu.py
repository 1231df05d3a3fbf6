"""Paged attention and K/V stores for the CPU serving path, faster than the torch reference.

Decode tokens (q_len 1) in float32 go to the C++ kernel of pagedserve/kernels/paged_decode_cpu.py (over
a float32 or a bfloat16 cache, in float32 arithmetic) and prompt chunks over a float32 cache to that
of pagedserve/kernels/paged_prefill_cpu.py, each reading every sequence's K/V in place from its
blocks of the pool (prompt chunks over a bfloat16 cache: the reference's _prefill); other dtypes, a sliding window or soft-capping, and
machines where the kernels cannot be built take the reference path
(pagedserve/kernels/paged_attention_ref.py), which stays the reference.
"""
from __future__ import annotations

import weakref

import torch

from pagedserve.kernels import paged_prefill_cpu
from pagedserve.kernels.paged_attention_ref import _prefill, paged_attention_ref
from pagedserve.kernels.paged_decode_cpu import native_available, paged_decode


def paged_attention_cpu(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out=None,
                        window=None, softcap=None):
    """pagedserve.kernels.paged_attention on the CPU: decodes and prefill chunks in place through the C++
    kernels. A sliding window or soft-capping takes the reference path."""
    if window is not None or softcap is not None:
        return paged_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out,
                                   window=window, softcap=softcap)
    if (q.dtype != torch.float32 or k_cache.dtype not in (torch.float32, torch.bfloat16)
            or k_cache.dtype != v_cache.dtype or k_cache.stride(3) != 1
            or k_cache.stride() != v_cache.stride() or not native_available()):
        return paged_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out)
    if out is None:
        out = torch.empty_like(q)
    plan = _memo(("attention", query_start_loc, seq_lens, block_tables),
                 lambda: _plan(block_tables, seq_lens, query_start_loc, k_cache.shape[2], q.shape[1]))
    gqa = q.shape[1] != k_cache.shape[2]
    qq = q if q.stride(2) == 1 else q.contiguous()
    target = out if out.stride(2) == 1 else torch.empty_like(qq)
    if plan.decode is not None:
        tables, lens, rows = plan.decode
        paged_decode(qq, k_cache, v_cache, tables, lens, rows, scale, target)
    native = (plan.chunks is not None and k_cache.dtype == torch.float32
              and paged_prefill_cpu.native_available())
    if native:
        paged_prefill_cpu.paged_prefill(qq, k_cache, v_cache, plan.tables, plan.chunks, plan.items, scale, target)
    if not native:
        for b, start, end, length in plan.prefills:
            _prefill(qq, k_cache, v_cache, block_tables[b], length, start, end, scale, gqa, target)
    if target is not out:
        out.copy_(target)
    return out


class _Plan:
    """What paged_attention_cpu derives from a step's metadata, the same for every layer:
    decode (int32 tables, int32 lens, int64 q rows) or None; prefills (b, start, end, length),
    and for the prefill kernel the same as an int64 tensor `chunks` with its work items (or
    None), and the int32 tables."""

    def __init__(self, decode, prefills, tables, kv_heads: int, num_heads: int):
        self.decode, self.prefills, self.tables = decode, prefills, tables
        self.chunks = self.items = None
        if prefills:
            self.chunks = torch.tensor(prefills, dtype=torch.int64)
            self.items = paged_prefill_cpu.work_items(prefills, kv_heads, num_heads // kv_heads)


def _plan(block_tables, seq_lens, query_start_loc, kv_heads: int, num_heads: int) -> _Plan:
    starts = query_start_loc.tolist()
    q_lens = [end - start for start, end in zip(starts, starts[1:])]
    lens = seq_lens.tolist()
    tables = block_tables.to(torch.int32).contiguous()
    decodes = [b for b, n in enumerate(q_lens) if n == 1]
    decode = None
    if len(decodes) == len(q_lens):
        decode = (tables, seq_lens.to(torch.int32).contiguous(),
                  torch.tensor(starts[:-1], dtype=torch.int64))
    elif decodes:
        index = torch.tensor(decodes, dtype=torch.int64)
        decode = (tables.index_select(0, index), seq_lens.to(torch.int32).index_select(0, index),
                  torch.tensor([starts[b] for b in decodes], dtype=torch.int64))
    prefills = [(b, starts[b], starts[b + 1], lens[b]) for b, n in enumerate(q_lens) if n > 1]
    return _Plan(decode, prefills, tables, kv_heads, num_heads)


_memo_entry: tuple | None = None


def _memo(key: tuple, build):
    """build() once for the same metadata tensors (the same objects) in a row: every layer of
    a step passes the same ones, and nothing modifies them (inference tensors have no version
    counter to check). Holds weak references only."""
    global _memo_entry
    tag, *tensors = key
    e = _memo_entry
    if (e is not None and e[0] == tag and len(e[1]) == len(tensors)
            and all(r() is t for r, t in zip(e[1], tensors))):
        return e[2]
    value = build()
    _memo_entry = (tag, [weakref.ref(t) for t in tensors], value)
    return value


def store_kv_cpu(key, value, k_cache, v_cache, slot_mapping) -> None:
    """pagedserve.kernels.store_kv on the CPU: one index_copy_ per cache over its [slots, kv_heads *
    head_size] rows (a strided view of the pool), skipping negative (padding) slots."""
    num_blocks, block_size = k_cache.shape[:2]
    sb, st = k_cache.stride(0), k_cache.stride(1)
    row = k_cache.shape[2] * k_cache.shape[3]
    if (k_cache.stride(2) != k_cache.shape[3] or k_cache.stride(3) != 1 or st != row
            or sb % st or k_cache.stride() != v_cache.stride()):
        from pagedserve.kernels.store_kv_ref import store_kv_ref

        return store_kv_ref(key, value, k_cache, v_cache, slot_mapping)
    rows_per_block = sb // st
    index, keep = _memo_store(("store", slot_mapping), block_size, rows_per_block, slot_mapping)
    if keep is not None:
        key, value = key[keep], value[keep]
    if index.numel() == 0:
        return
    for cache, new in ((k_cache, key), (v_cache, value)):
        flat = cache.as_strided(((num_blocks - 1) * rows_per_block + block_size, row), (st, 1))
        flat.index_copy_(0, index, new.reshape(-1, row).to(cache.dtype))


_store_entry: tuple | None = None


def _memo_store(key, block_size, rows_per_block, slot_mapping):
    """(row index into the strided 2-D view, mask of non-padding slots or None), computed once
    per step's slot_mapping and geometry."""
    global _store_entry
    e = _store_entry
    if e is not None and e[0]() is slot_mapping and e[1] == (block_size, rows_per_block):
        return e[2]
    slots = slot_mapping.to(dtype=torch.long)
    keep = None
    if slots.numel() and bool((slots < 0).any()):
        keep = slots >= 0
        slots = slots[keep]
    # row r of the strided 2-D view is block r // block_size, offset r % block_size
    index = (slots // block_size) * rows_per_block + slots % block_size
    value = (index, keep)
    _store_entry = (weakref.ref(slot_mapping), (block_size, rows_per_block), value)
    return value
