"""The prefill attention kernel of the CPU path, in C++: every prompt chunk of a step in one
call, float32, reading each sequence's K/V in place from its blocks of the pool.

paged_prefill(q, k_cache, v_cache, block_tables, chunks, scale, out): `chunks` [n, 4] int64
rows (b, start, end, length): the queries q[start:end] of sequence b, whose context is
`length` tokens (the last end - start of them are the chunk's own; those before, its cached
prefix), attend causally over block_tables[b]. Work is split over (chunk, query tile of 16,
kv head) on torch's OpenMP threads, the GIL released (ctypes); within a tile each key and
value row is read once for all the tile's queries and the heads sharing it (GQA), with an
online softmax per query, so no K/V is gathered and no score matrix larger than a block is
held (each block's K is transposed once per tile, so scores vectorize over its keys). Built as pagedserve/kernels/paged_decode_cpu.py is (pagedserve/kernels/native_build.py); tested against the
torch reference through pagedserve/kernels/paged_cpu.py (tests/unit/kernels/test_kernels_cpu.py).
"""
from __future__ import annotations

import ctypes

import torch

from pagedserve.kernels import native_build
from pagedserve.kernels.paged_decode_cpu import EXP_NEG

TILE = 16  # query rows per work item
# chunks of more queries go to SDPA (pagedserve/kernels/paged_attention_ref.py), faster there: 1 x 1,024
# tokens 0.74x of it, 1 x 512 1.22x, 8 x 128 6.5x (docs/benchmark-history.md, issue 44)
MAX_CHUNK = 512

SOURCE = EXP_NEG + r"""
// Prefill attention over the paged KV pool: causal, each chunk after its cached prefix.

// One query's scores against a block's keys (kt: [D][BS], keys along a vector); BS known at
// compile time keeps the scores in vector registers while d runs.
template <int BS>
static inline void scores_fixed(const float* qi, const float* kt, int64_t D, float* s) {
    float a[BS] = {};
    for (int64_t d = 0; d < D; ++d) {
        const float qd = qi[d];
        const float* kd = kt + d * BS;
#pragma omp simd
        for (int t = 0; t < BS; ++t) a[t] += qd * kd[t];
    }
    for (int t = 0; t < BS; ++t) s[t] = a[t];
}

static inline void scores_any(const float* qi, const float* kt, int64_t D, int64_t bs, float* s) {
    if (bs == 16) return scores_fixed<16>(qi, kt, D, s);
    if (bs == 32) return scores_fixed<32>(qi, kt, D, s);
#pragma omp simd
    for (int64_t t = 0; t < bs; ++t) s[t] = 0.f;
    for (int64_t d = 0; d < D; ++d) {
        const float qd = qi[d];
        const float* kd = kt + d * bs;
#pragma omp simd
        for (int64_t t = 0; t < bs; ++t) s[t] += qd * kd[t];
    }
}
static void prefill_tile(const float* q, int64_t q_st, int64_t q_sh, const float* k, const float* v,
                         int64_t sb, int64_t st, int64_t sh, const int32_t* table, int64_t first, int64_t rows,
                         int64_t pos0, float* out, int64_t o_st, int64_t o_sh, int64_t kvh, int64_t group,
                         int64_t head_size, int64_t block_size, float scale,
                         float* qs, float* acc, float* m, float* l, float* sc, float* kt) {
    const int64_t R = rows * group, D = head_size;
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t g = 0; g < group; ++g) {
            const float* src = q + (first + r) * q_st + (kvh * group + g) * q_sh;
            float* dst = qs + (r * group + g) * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * scale;
        }
    std::fill(acc, acc + R * D, 0.f);
    std::fill(m, m + R, -INFINITY);
    std::fill(l, l + R, 0.f);
    const int64_t last = pos0 + rows - 1;  // the tile's last query position: keys 0..last
    for (int64_t j = 0; j * block_size <= last; ++j) {
        const int64_t base = j * block_size;
        const int64_t n = std::min(block_size, last + 1 - base);
        const float* kb = k + static_cast<int64_t>(table[j]) * sb + kvh * sh;
        const float* vb = v + static_cast<int64_t>(table[j]) * sb + kvh * sh;
        for (int64_t t = 0; t < n; ++t) {  // K of this block transposed: kt[d][t], keys along a vector
            const float* kr = kb + t * st;
            for (int64_t d = 0; d < D; ++d) kt[d * block_size + t] = kr[d];
        }
        for (int64_t i = 0; i < R; ++i) {  // scores of this block: sc[i][t]
            const float* qi = qs + i * D;
            const int64_t see = std::min(n, pos0 + i / group + 1 - base);  // causal: keys <= its position
            float* s = sc + i * block_size;
            scores_any(qi, kt, D, block_size, s);
            for (int64_t t = see < 0 ? 0 : see; t < n; ++t) s[t] = -INFINITY;
        }
        for (int64_t i = 0; i < R; ++i) {
            float* s = sc + i * block_size;
            float mb = -INFINITY;
            for (int64_t t = 0; t < n; ++t) mb = std::max(mb, s[t]);
            if (mb == -INFINITY) continue;
            const float mn = std::max(m[i], mb);
            const float alpha = m[i] == -INFINITY ? 0.f : exp_neg(m[i] - mn);
            float sum = 0.f;
#pragma omp simd reduction(+ : sum)
            for (int64_t t = 0; t < n; ++t) {
                const float p = s[t] == -INFINITY ? 0.f : exp_neg(s[t] - mn);
                s[t] = p;
                sum += p;
            }
            l[i] = l[i] * alpha + sum;
            m[i] = mn;
            float* a = acc + i * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] *= alpha;
            for (int64_t t = 0; t < n; ++t) {
                const float p = s[t];
                if (p == 0.f) continue;
                const float* vt = vb + t * st;
#pragma omp simd
                for (int64_t d = 0; d < D; ++d) a[d] += p * vt[d];
            }
        }
    }
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t g = 0; g < group; ++g) {
            const int64_t i = r * group + g;
            const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
            float* dst = out + (first + r) * o_st + (kvh * group + g) * o_sh;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) dst[d] = acc[i * D + d] * inv;
        }
}

extern "C" {

// chunks: n_chunks rows of (b, start, end, length); items: n_items rows of (chunk, first row, kv head)
void paged_prefill_f32(const float* q, int64_t q_st, int64_t q_sh, const float* k, const float* v,
                       int64_t sb, int64_t st, int64_t sh, const int32_t* tables, int64_t table_stride,
                       const int64_t* chunks, const int64_t* items, int64_t n_items, float* out,
                       int64_t o_st, int64_t o_sh, int64_t num_heads, int64_t kv_heads, int64_t head_size,
                       int64_t block_size, float scale, int64_t tile, int64_t threads) {
    const int64_t group = num_heads / kv_heads;
#pragma omp parallel num_threads(threads)
    {
    std::vector<float> qs(tile * group * head_size), acc(tile * group * head_size), m(tile * group),
        l(tile * group), sc(tile * group * block_size), kt(head_size * block_size, 0.f);
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < n_items; ++w) {
        const int64_t* c = chunks + items[3 * w] * 4;
        const int64_t b = c[0], start = c[1], end = c[2], length = c[3];
        const int64_t first = items[3 * w + 1], kvh = items[3 * w + 2];
        const int64_t rows = std::min(tile, end - first);
        const int64_t pos0 = length - (end - start) + (first - start);
        prefill_tile(q, q_st, q_sh, k, v, sb, st, sh, tables + b * table_stride, first, rows, pos0, out, o_st,
                     o_sh, kvh, group, head_size, block_size, scale, qs.data(), acc.data(), m.data(), l.data(),
                     sc.data(), kt.data());
    }
    }
}

}  // extern "C"
"""


def _build() -> ctypes.CDLL | None:
    lib = native_build.load("paged_prefill_cpu", SOURCE)
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    f = lib.paged_prefill_f32
    f.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, i64, ptr, i64, ptr, ptr, i64, ptr, i64, i64, i64, i64,
                  i64, i64, ctypes.c_float, i64, i64]
    f.restype = None
    return lib


_native = native_build.Library(_build)


def native_available() -> bool:
    """Whether the C++ prefill kernel is built and loaded (builds it on first call)."""
    return _native.get() is not None


def work_items(chunks: list[tuple[int, int, int, int]], kv_heads: int) -> torch.Tensor:
    """(chunk, first query row, kv head) per work item, int64 [n, 3]; the same for every layer."""
    items = [(c, first, h) for c, (_, start, end, _) in enumerate(chunks)
             for first in range(start, end, TILE) for h in range(kv_heads)]
    return torch.tensor(items, dtype=torch.int64).reshape(-1, 3)


def paged_prefill(q, k_cache, v_cache, block_tables, chunks: torch.Tensor, items: torch.Tensor, scale, out) -> None:
    """Prefill attention for `chunks` [n, 4] (b, start, end, length) over `items`
    (work_items), written to out[start:end]. float32 CPU tensors; k/v caches with a
    contiguous last dimension; q and out with a contiguous last dimension."""
    num_heads, head_size = q.shape[1], q.shape[2]
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
    assert q.stride(2) == 1 and out.stride(2) == 1
    tables = block_tables if block_tables.dtype == torch.int32 else block_tables.to(torch.int32)
    tables = tables if tables.stride(1) == 1 else tables.contiguous()
    sb, st, sh, _ = k_cache.stride()
    n = items.shape[0]
    threads = max(1, min(torch.get_num_threads(), n))
    _native.get().paged_prefill_f32(
        q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(), sb, st, sh,
        tables.data_ptr(), tables.stride(0), chunks.data_ptr(), items.data_ptr(), n, out.data_ptr(),
        out.stride(0), out.stride(1), num_heads, kv_heads, head_size, block_size, float(scale), TILE, threads)
