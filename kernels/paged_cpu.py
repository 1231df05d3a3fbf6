"""Paged attention and K/V stores for the CPU serving path, faster than the torch reference.

Decode tokens (q_len 1) in float32 go to a small C++ kernel that reads each sequence's K/V
in place from its blocks of the pool (no per-layer gather or copy), split over the torch
thread count on torch's own OpenMP threads, GIL released; prefill chunks, other dtypes, and machines where the
kernel cannot be built take the reference path (kernels/paged_attention_ref.py), which
stays the reference. The kernel is compiled once per source and machine with the system
C++ compiler (about a second; plain C ABI through ctypes, no torch headers) and cached in
$PAGEDSERVE_CACHE or ~/.cache/pagedserve (kernels/native_build.py).
PAGEDSERVE_NATIVE_KERNELS=0 turns it off.
"""
from __future__ import annotations

import ctypes
import weakref

import torch

from kernels import native_build
from kernels.paged_attention_ref import _prefill, paged_attention_ref

SOURCE = r"""
// Decode attention (one query per sequence) over the paged KV pool, in place: each sequence's
// K/V are read straight from its blocks, nothing is gathered or copied. float32.
// Built by kernels/paged_attention_cpu.py with the system C++ compiler; plain C ABI (ctypes),
// no torch headers. Built with -fopenmp: the parallel loop below runs on the OpenMP runtime
// torch already loaded (same soname), so the kernel shares torch's warm thread pool instead
// of competing with its spinning threads.
#include <cmath>
#include <cstdint>
#include <vector>
#include <algorithm>

extern "C" {

// q, out: rows indexed by q_rows[b] (row stride q_sr / o_sr, head stride q_sh / o_sh, dim 1).
// k, v: caches [num_blocks, block_size, kv_heads, head_size] with strides (sb, st, sh, 1).
// tables: int32 [B, table_stride]; seq_lens: int32 [B].
// Work items w in [0, B * kv_heads): b = w / kv_heads, kv head = w % kv_heads, split over
// `threads` OpenMP threads.
void paged_decode_f32(const float* q, int64_t q_sr, int64_t q_sh,
                      const float* k, const float* v, int64_t sb, int64_t st, int64_t sh,
                      const int32_t* tables, int64_t table_stride, const int32_t* seq_lens,
                      const int64_t* q_rows, float* out, int64_t o_sr, int64_t o_sh,
                      int64_t num_heads, int64_t kv_heads, int64_t head_size, int64_t block_size,
                      float scale, int64_t work, int64_t threads) {
    const int64_t group = num_heads / kv_heads;
#pragma omp parallel num_threads(threads)
    {
    std::vector<float> scores, qs(group * head_size), acc(group * head_size);
#pragma omp for schedule(static)
    for (int64_t w = 0; w < work; ++w) {
        const int64_t b = w / kv_heads, kh = w % kv_heads;
        const int64_t len = seq_lens[b];
        const int32_t* table = tables + b * table_stride;
        const int64_t row = q_rows[b];
        for (int64_t g = 0; g < group; ++g) {
            const float* src = q + row * q_sr + (kh * group + g) * q_sh;
            for (int64_t d = 0; d < head_size; ++d) qs[g * head_size + d] = src[d] * scale;
        }
        scores.resize(group * len);
        // pass 1: scores[g][t] = q_g . k_t
        for (int64_t t0 = 0; t0 < len; t0 += block_size) {
            const int64_t blk = table[t0 / block_size];
            const int64_t n = std::min(block_size, len - t0);
            for (int64_t i = 0; i < n; ++i) {
                const float* kp = k + blk * sb + i * st + kh * sh;
                for (int64_t g = 0; g < group; ++g) {
                    const float* qg = qs.data() + g * head_size;
                    float s = 0.f;
#pragma omp simd reduction(+ : s)
                    for (int64_t d = 0; d < head_size; ++d) s += qg[d] * kp[d];
                    scores[g * len + t0 + i] = s;
                }
            }
        }
        // softmax per query head
        for (int64_t g = 0; g < group; ++g) {
            float* sc = scores.data() + g * len;
            float m = -INFINITY;
            for (int64_t t = 0; t < len; ++t) m = std::max(m, sc[t]);
            float sum = 0.f;
            for (int64_t t = 0; t < len; ++t) {
                sc[t] = std::exp(sc[t] - m);
                sum += sc[t];
            }
            const float inv = 1.f / sum;
            for (int64_t t = 0; t < len; ++t) sc[t] *= inv;
        }
        // pass 2: out_g = sum_t p[g][t] v_t
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t t0 = 0; t0 < len; t0 += block_size) {
            const int64_t blk = table[t0 / block_size];
            const int64_t n = std::min(block_size, len - t0);
            for (int64_t i = 0; i < n; ++i) {
                const float* vp = v + blk * sb + i * st + kh * sh;
                for (int64_t g = 0; g < group; ++g) {
                    const float p = scores[g * len + t0 + i];
                    float* a = acc.data() + g * head_size;
#pragma omp simd
                    for (int64_t d = 0; d < head_size; ++d) a[d] += p * vp[d];
                }
            }
        }
        for (int64_t g = 0; g < group; ++g) {
            float* dst = out + row * o_sr + (kh * group + g) * o_sh;
            for (int64_t d = 0; d < head_size; ++d) dst[d] = acc[g * head_size + d];
        }
    }
    }
}

}  // extern "C"
"""

def _build() -> ctypes.CDLL | None:
    lib = native_build.load("paged_attention_cpu", SOURCE)
    if lib is None:
        return None
    f = lib.paged_decode_f32
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    f.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, i64, ptr, i64, ptr, ptr, ptr, i64, i64,
                  i64, i64, i64, i64, ctypes.c_float, i64, i64]  # ..., work, threads
    f.restype = None
    return lib


_native = native_build.Library(_build)


def native_available() -> bool:
    """Whether the C++ decode kernel is built and loaded (builds it on first call)."""
    return _native.get() is not None


def _threads(work: int) -> int:
    return max(1, min(torch.get_num_threads(), work // 8 or 1))


def paged_decode(q, k_cache, v_cache, block_tables, seq_lens, rows, scale, out) -> None:
    """Decode attention for the sequences whose single query sits at q[rows[b]], written to
    out[rows[b]]. float32 CPU tensors; k/v caches with a contiguous last dimension."""
    num_heads, head_size = q.shape[1], q.shape[2]
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
    assert q.stride(2) == 1 and out.stride(2) == 1
    tables = block_tables if block_tables.dtype == torch.int32 else block_tables.to(torch.int32)
    tables = tables if tables.stride(1) == 1 else tables.contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    rows = rows.to(torch.int64).contiguous()
    sb, st, sh, _ = k_cache.stride()
    args = (q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(), sb, st, sh,
            tables.data_ptr(), tables.stride(0), lens.data_ptr(), rows.data_ptr(), out.data_ptr(),
            out.stride(0), out.stride(1), num_heads, kv_heads, head_size, block_size, float(scale))
    work = rows.numel() * kv_heads
    kernel = _native.get().paged_decode_f32
    kernel(*args, work, _threads(work))


def paged_attention_cpu(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out=None,
                        window=None, softcap=None):
    """kernels.paged_attention on the CPU: decodes in place through the C++ kernel, prefill
    chunks as in the reference. A sliding window or soft-capping takes the reference path."""
    if window is not None or softcap is not None:
        return paged_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out,
                                   window=window, softcap=softcap)
    if (q.dtype != torch.float32 or k_cache.dtype != torch.float32 or k_cache.stride(3) != 1
            or k_cache.stride() != v_cache.stride() or not native_available()):
        return paged_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out)
    if out is None:
        out = torch.empty_like(q)
    plan = _memo(("attention", query_start_loc, seq_lens, block_tables),
                 lambda: _plan(block_tables, seq_lens, query_start_loc))
    gqa = q.shape[1] != k_cache.shape[2]
    qq = q if q.stride(2) == 1 else q.contiguous()
    target = out if out.stride(2) == 1 else torch.empty_like(qq)
    if plan.decode is not None:
        tables, lens, rows = plan.decode
        paged_decode(qq, k_cache, v_cache, tables, lens, rows, scale, target)
    for b, start, end, length in plan.prefills:
        _prefill(qq, k_cache, v_cache, block_tables[b], length, start, end, scale, gqa, target)
    if target is not out:
        out.copy_(target)
    return out


class _Plan:
    """What paged_attention_cpu derives from a step's metadata, the same for every layer:
    decode (int32 tables, int32 lens, int64 q rows) or None; prefills (b, start, end, length)."""

    def __init__(self, decode, prefills):
        self.decode, self.prefills = decode, prefills


def _plan(block_tables, seq_lens, query_start_loc) -> _Plan:
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
    return _Plan(decode, prefills)


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
    """kernels.store_kv on the CPU: one index_copy_ per cache over its [slots, kv_heads *
    head_size] rows (a strided view of the pool), skipping negative (padding) slots."""
    num_blocks, block_size = k_cache.shape[:2]
    sb, st = k_cache.stride(0), k_cache.stride(1)
    row = k_cache.shape[2] * k_cache.shape[3]
    if (k_cache.stride(2) != k_cache.shape[3] or k_cache.stride(3) != 1 or st != row
            or sb % st or k_cache.stride() != v_cache.stride()):
        from kernels.store_kv_ref import store_kv_ref

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
