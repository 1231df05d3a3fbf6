"""The decode attention kernel of the CPU path, in C++: one query per sequence, float32.

paged_decode(q, k_cache, v_cache, tables, lens, rows, scale, out) reads each sequence's K/V
in place from its blocks of the pool (no per-layer gather or copy), sequences split over
the torch thread count on torch's own OpenMP threads, the GIL released (ctypes). The common
head sizes (64, 128) and query heads per kv head (1-8) take a path whose queries and
accumulators stay in vector registers while the tokens stream by, the next block's rows
prefetched (blocks lie anywhere in the pool); others a generic loop. Compiled once per
source and machine with the system C++ compiler and cached (pagedserve/kernels/native_build.py);
PAGEDSERVE_NATIVE_KERNELS=0 turns it off. Tested through pagedserve/kernels/paged_cpu.py against the
torch reference (tests/unit/kernels/test_kernels_cpu.py).
"""
from __future__ import annotations

import ctypes

import torch

from pagedserve.kernels import native_build

# the includes and the vectorizable exp of the softmax, shared with pagedserve/kernels/paged_prefill_cpu.py
EXP_NEG = r"""
// Decode attention (one query per sequence) over the paged KV pool, in place: each sequence's
// K/V are read straight from its blocks, nothing is gathered or copied. float32.
// Built by pagedserve/kernels/paged_decode_cpu.py with the system C++ compiler; plain C ABI (ctypes),
// no torch headers. Built with -fopenmp: the parallel loop below runs on the OpenMP runtime
// torch already loaded (same soname), so the kernel shares torch's warm thread pool instead
// of competing with its spinning threads.
#include <cmath>
#include <cstdint>
#include <vector>
#include <algorithm>

// exp(x) for the softmax (x <= 0 there): 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2, p the
// degree-6 Taylor polynomial (relative error < 2e-7 over that range); plain arithmetic, so
// the loops calling it vectorize (std::exp does not, without -ffast-math).
static inline float exp_neg(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = __builtin_floorf(x * 1.44269504f + 0.5f);
    const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f;
    float p = 1.f / 720;
    p = p * r + 1.f / 120;
    p = p * r + 1.f / 24;
    p = p * r + 1.f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    union { int32_t i; float f; } bits;
    bits.i = (static_cast<int32_t>(n) + 127) << 23;
    return p * bits.f;
}

"""

SOURCE = EXP_NEG + r"""
// Each of `heads` rows of `len` scores replaced by its softmax, in place.
static void softmax_rows(float* scores, int64_t heads, int64_t len) {
    for (int64_t h = 0; h < heads; ++h) {
        float* sc = scores + h * len;
        float m = -INFINITY;
        for (int64_t t = 0; t < len; ++t) m = std::max(m, sc[t]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; ++t) {
            sc[t] = exp_neg(sc[t] - m);
            sum += sc[t];
        }
        const float inv = 1.f / sum;
#pragma omp simd
        for (int64_t t = 0; t < len; ++t) sc[t] *= inv;
    }
}

// The next block's rows, asked for ahead of use: blocks lie anywhere in the pool, so the
// hardware's stream prefetchers (which follow one page) start cold at every block.
static inline void prefetch_rows(const float* first, int64_t st, int64_t row_bytes, int64_t rows) {
    for (int64_t i = 0; i < rows; ++i) {
        const char* p = reinterpret_cast<const char*>(first + i * st);
        for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(p + b);
    }
}

// Calls f(row, t) for each of a sequence's tokens t in order, row pointing at its K or V row
// (all kv heads) in `cache`; with `ahead`, the first block and then each next block's rows
// are prefetched while the one before is walked.
template <class F>
static inline void walk(const float* cache, const int32_t* table, int64_t len, int64_t block_size,
                        int64_t sb, int64_t st, int64_t row_bytes, bool ahead, F f) {
    if (ahead) prefetch_rows(cache + table[0] * sb, st, row_bytes, std::min(block_size, len));
    for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const int64_t blk = table[t0 / block_size];
        const int64_t n = std::min(block_size, len - t0);
        if (ahead && t0 + block_size < len)
            prefetch_rows(cache + table[t0 / block_size + 1] * sb, st, row_bytes, block_size);
        for (int64_t i = 0; i < n; ++i) f(cache + blk * sb + i * st, t0 + i);
    }
}

// One sequence's decode attention, every head: pass 1 reads each token's K row (all kv heads,
// contiguous) once for every query head, the softmax runs per head, pass 2 reads each V row
// once. Any head size and group (decode_fixed is the fast path for the common ones).
static void decode_one(const float* q, int64_t q_sh, const float* k, const float* v, int64_t sb,
                       int64_t st, int64_t sh, const int32_t* table, int64_t len, float* out,
                       int64_t o_sh, int64_t num_heads, int64_t group, int64_t head_size,
                       int64_t block_size, float scale, float* qs, float* scores, float* acc) {
    const int64_t hd = head_size;
    int64_t kv_of[num_heads];  // each query head's kv head (no division in the loops)
    for (int64_t h = 0; h < num_heads; ++h) kv_of[h] = h / group;
    const int64_t row = (kv_of[num_heads - 1] * sh + hd) * sizeof(float);  // bytes of a token's K
    for (int64_t h = 0; h < num_heads; ++h)
        for (int64_t d = 0; d < hd; ++d) qs[h * hd + d] = q[h * q_sh + d] * scale;
    walk(k, table, len, block_size, sb, st, row, true, [&](const float* kt, int64_t t) {
        for (int64_t h = 0; h < num_heads; ++h) {
            const float* kp = kt + kv_of[h] * sh;
            const float* qh = qs + h * hd;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < hd; ++d) s += qh[d] * kp[d];
            scores[h * len + t] = s;
        }
    });
    softmax_rows(scores, num_heads, len);
    std::fill(acc, acc + num_heads * hd, 0.f);
    walk(v, table, len, block_size, sb, st, row, true, [&](const float* vt, int64_t t) {
        for (int64_t h = 0; h < num_heads; ++h) {
            const float* vp = vt + kv_of[h] * sh;
            const float p = scores[h * len + t];
            float* a = acc + h * hd;
#pragma omp simd
            for (int64_t d = 0; d < hd; ++d) a[d] += p * vp[d];
        }
    });
    for (int64_t h = 0; h < num_heads; ++h)
        for (int64_t d = 0; d < hd; ++d) out[h * o_sh + d] = acc[h * hd + d];
}

#if defined(__AVX512F__)
#define VL 16
#elif defined(__AVX__)
#define VL 8
#else
#define VL 4
#endif
typedef float vec __attribute__((vector_size(VL * 4)));
static inline vec vload(const float* p) { vec x; __builtin_memcpy(&x, p, sizeof x); return x; }
static inline void vstore(float* p, vec x) { __builtin_memcpy(p, &x, sizeof x); }
static inline float hsum(vec x) { float s = 0.f; for (int i = 0; i < VL; ++i) s += x[i]; return s; }

// decode_one for a head size D and G query heads per kv head known at compile time: per kv
// head, its G queries (pass 1) and G accumulators (pass 2) stay in vector registers while
// the sequence's tokens stream by, each K and V row loaded once per kv head.
template <int D, int G>
static void decode_fixed(const float* q, int64_t q_sh, const float* k, const float* v, int64_t sb,
                         int64_t st, int64_t sh, const int32_t* table, int64_t len, float* out,
                         int64_t o_sh, int64_t kv_heads, int64_t block_size, float scale,
                         float* scores) {
    constexpr int NV = D / VL;
    const int64_t row = ((kv_heads - 1) * sh + D) * sizeof(float);
    for (int64_t kh = 0; kh < kv_heads; ++kh) {  // the first kv head's walk prefetches
        vec qv[G][NV];
        for (int g = 0; g < G; ++g)
            for (int j = 0; j < NV; ++j) qv[g][j] = vload(q + (kh * G + g) * q_sh + j * VL) * scale;
        float* sc = scores + kh * G * len;
        walk(k, table, len, block_size, sb, st, row, kh == 0, [&](const float* kt, int64_t t) {
            vec kv[NV];
            for (int j = 0; j < NV; ++j) kv[j] = vload(kt + kh * sh + j * VL);
            for (int g = 0; g < G; ++g) {
                vec a = qv[g][0] * kv[0];
                for (int j = 1; j < NV; ++j) a += qv[g][j] * kv[j];
                sc[g * len + t] = hsum(a);
            }
        });
    }
    softmax_rows(scores, kv_heads * G, len);
    for (int64_t kh = 0; kh < kv_heads; ++kh) {
        vec acc[G][NV];
        for (int g = 0; g < G; ++g)
            for (int j = 0; j < NV; ++j) acc[g][j] = vec{};
        const float* sc = scores + kh * G * len;
        walk(v, table, len, block_size, sb, st, row, kh == 0, [&](const float* vt, int64_t t) {
            vec vv[NV];
            for (int j = 0; j < NV; ++j) vv[j] = vload(vt + kh * sh + j * VL);
            for (int g = 0; g < G; ++g) {
                const float p = sc[g * len + t];
                for (int j = 0; j < NV; ++j) acc[g][j] += p * vv[j];
            }
        });
        for (int g = 0; g < G; ++g)
            for (int j = 0; j < NV; ++j) vstore(out + (kh * G + g) * o_sh + j * VL, acc[g][j]);
    }
}

// The fast path's head sizes and groups; false: decode_one.
template <int D>
static bool decode_group(int64_t group, const float* q, int64_t q_sh, const float* k, const float* v,
                         int64_t sb, int64_t st, int64_t sh, const int32_t* table, int64_t len,
                         float* out, int64_t o_sh, int64_t kv_heads, int64_t block_size, float scale,
                         float* scores) {
#define FIXED(G) decode_fixed<D, G>(q, q_sh, k, v, sb, st, sh, table, len, out, o_sh, kv_heads, \
                                    block_size, scale, scores)
    switch (group) {
        case 1: FIXED(1); return true;
        case 2: FIXED(2); return true;
        case 3: FIXED(3); return true;
        case 4: FIXED(4); return true;
        case 5: FIXED(5); return true;
        case 6: FIXED(6); return true;
        case 7: FIXED(7); return true;
        case 8: FIXED(8); return true;
        default: return false;
    }
#undef FIXED
}

extern "C" {

// q, out: rows indexed by q_rows[b] (row stride q_sr / o_sr, head stride q_sh / o_sh, dim 1).
// k, v: caches [num_blocks, block_size, kv_heads, head_size] with strides (sb, st, sh, 1).
// tables: int32 [B, table_stride]; seq_lens: int32 [B]. Sequences split over `threads`
// OpenMP threads.
void paged_decode_f32(const float* q, int64_t q_sr, int64_t q_sh,
                      const float* k, const float* v, int64_t sb, int64_t st, int64_t sh,
                      const int32_t* tables, int64_t table_stride, const int32_t* seq_lens,
                      const int64_t* q_rows, float* out, int64_t o_sr, int64_t o_sh,
                      int64_t num_heads, int64_t kv_heads, int64_t head_size, int64_t block_size,
                      float scale, int64_t work, int64_t threads) {
    const int64_t group = num_heads / kv_heads;
#pragma omp parallel num_threads(threads)
    {
    std::vector<float> scores, qs(num_heads * head_size), acc(num_heads * head_size);
#pragma omp for schedule(dynamic, 1)
    for (int64_t b = 0; b < work; ++b) {
        const int64_t len = seq_lens[b];
        scores.resize(num_heads * len);
        const float* qb = q + q_rows[b] * q_sr;
        float* ob = out + q_rows[b] * o_sr;
        const int32_t* table = tables + b * table_stride;
        const bool fixed =
            head_size == 64 ? decode_group<64>(group, qb, q_sh, k, v, sb, st, sh, table, len, ob, o_sh,
                                               kv_heads, block_size, scale, scores.data())
            : head_size == 128 ? decode_group<128>(group, qb, q_sh, k, v, sb, st, sh, table, len, ob,
                                                   o_sh, kv_heads, block_size, scale, scores.data())
            : false;
        if (!fixed)
            decode_one(qb, q_sh, k, v, sb, st, sh, table, len, ob, o_sh, num_heads, group, head_size,
                       block_size, scale, qs.data(), scores.data(), acc.data());
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
    work = rows.numel()
    kernel = _native.get().paged_decode_f32
    kernel(*args, work, _threads(work * kv_heads))
