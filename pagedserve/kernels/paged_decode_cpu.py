"""The decode attention kernel of the CPU path, in C++: one query per sequence, float32.

paged_decode(q, k_cache, v_cache, tables, lens, rows, scale, out) reads each sequence's K/V
in place from its blocks of the pool (no per-layer gather or copy), sequences split over
the torch thread count on torch's own OpenMP threads, the GIL released (ctypes). The common
head sizes (64, 128) and query heads per kv head (1-8) take one pass over each sequence's
blocks with an online softmax: a block's K rows and then its V rows are read once, in the
order they lie, a head's accumulators in vector registers over four tokens of P.V, the next
block prefetched while this one is used
(blocks lie anywhere in the pool), no denormal ever computed; others a generic two-pass
loop. Compiled once per source and machine with the system C++ compiler and cached
(pagedserve/kernels/native_build.py; AVX-512 or AVX2 as -march gives);
PAGEDSERVE_NATIVE_KERNELS=0 turns it off. Tested against the torch reference through
pagedserve/kernels/paged_cpu.py (tests/unit/kernels/test_kernels_cpu.py) and against float64
(tests/unit/kernels/test_decode_cpu.py; the AVX2 build in tests/integration/test_decode_cpu_avx2.py);
measured by scripts/bench_decode_cpu.py.
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
// the loops calling it vectorize (std::exp does not, without -ffast-math). x is clamped at
// -80: the result stays a normal float (a denormal costs a microcode assist in every
// arithmetic it enters, on Intel about a hundred cycles), and exp(-80) is 0 beside a sum >= 1.
static inline float exp_neg(float x) {
    x = x < -80.0f ? -80.0f : x;
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

# vectors of the widest width the target has (VL floats), their loads and stores, a horizontal
# sum, and exp_neg on a vector; shared with pagedserve/kernels/paged_prefill_cpu.py
VEC = r"""
#if defined(__AVX512F__)
#define VL 16
#elif defined(__AVX__)
#define VL 8
#else
#define VL 4
#endif
typedef float vec __attribute__((vector_size(VL * 4)));
typedef float vec8 __attribute__((vector_size(32)));
typedef float vec4 __attribute__((vector_size(16)));
static inline vec vload(const float* p) { vec x; __builtin_memcpy(&x, p, sizeof x); return x; }
static inline void vstore(float* p, vec x) { __builtin_memcpy(p, &x, sizeof x); }
// A tree of shuffles and adds (a plain loop over the lanes is a serial chain of scalar adds:
// without -ffast-math the compiler may not reorder them).
static inline float hsum4(vec4 x) {
    x += __builtin_shufflevector(x, x, 2, 3, 0, 1);
    return x[0] + x[1];
}
static inline float hsum8(vec8 x) {
    return hsum4(__builtin_shufflevector(x, x, 0, 1, 2, 3) + __builtin_shufflevector(x, x, 4, 5, 6, 7));
}
static inline float hsum(vec x) {
#if VL == 16
    return hsum8(__builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
                 __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15));
#elif VL == 8
    return hsum8(x);
#else
    return hsum4(x);
#endif
}

typedef int32_t ivec __attribute__((vector_size(VL * 4)));
typedef uint16_t hvec __attribute__((vector_size(VL * 2)));
static inline vec vload_kv(const float* p) { return vload(p); }
static inline vec vload_kv(const uint16_t* p) {
    hvec h;
    __builtin_memcpy(&h, p, sizeof h);
    const ivec bits = __builtin_convertvector(h, ivec) << 16;
    vec x;
    __builtin_memcpy(&x, &bits, sizeof x);
    return x;
}
static const float iota[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
// exp_neg on a vector (x <= 0): the same polynomial, n rounded by adding 1.5 * 2^23.
static inline vec exp_neg_v(vec x) {
    const vec lo = vec{} - 80.0f;
    x = x < lo ? lo : x;
    const vec n = (x * 1.44269504f + 12582912.0f) - 12582912.0f;
    const vec r = (x - n * 0.693145752f) - n * 1.42860677e-6f;
    vec p = vec{} + 1.f / 720;
    p = p * r + 1.f / 120;
    p = p * r + 1.f / 24;
    p = p * r + 1.f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    const ivec bits = (__builtin_convertvector(n, ivec) + 127) << 23;
    vec two_n;
    __builtin_memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

"""

SOURCE = EXP_NEG + VEC + r"""
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

// K/V elements: float32, or bfloat16 held as uint16_t (its bits are a float32's high half).
static inline float tofloat(float x) { return x; }
static inline float tofloat(uint16_t x) {
    const uint32_t u = static_cast<uint32_t>(x) << 16;
    float f;
    __builtin_memcpy(&f, &u, sizeof f);
    return f;
}

// The next block's rows, asked for ahead of use: blocks lie anywhere in the pool, so the
// hardware's stream prefetchers (which follow one page) start cold at every block.
template <class T>
static inline void prefetch_rows(const T* first, int64_t st, int64_t row_bytes, int64_t rows) {
    for (int64_t i = 0; i < rows; ++i) {
        const char* p = reinterpret_cast<const char*>(first + i * st);
        for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(p + b);
    }
}

// Calls f(row, t) for each of a sequence's tokens t in order, row pointing at its K or V row
// (all kv heads) in `cache`; with `ahead`, the first block and then each next block's rows
// are prefetched while the one before is walked.
template <class T, class F>
static inline void walk(const T* cache, const int32_t* table, int64_t len, int64_t block_size,
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
template <class T>
static void decode_one(const float* q, int64_t q_sh, const T* k, const T* v, int64_t sb,
                       int64_t st, int64_t sh, const int32_t* table, int64_t len, float* out,
                       int64_t o_sh, int64_t num_heads, int64_t group, int64_t head_size,
                       int64_t block_size, float scale, float* qs, float* scores, float* acc) {
    const int64_t hd = head_size;
    int64_t kv_of[num_heads];  // each query head's kv head (no division in the loops)
    for (int64_t h = 0; h < num_heads; ++h) kv_of[h] = h / group;
    const int64_t row = (kv_of[num_heads - 1] * sh + hd) * sizeof(T);  // bytes of a token's K
    for (int64_t h = 0; h < num_heads; ++h)
        for (int64_t d = 0; d < hd; ++d) qs[h * hd + d] = q[h * q_sh + d] * scale;
    walk(k, table, len, block_size, sb, st, row, true, [&](const T* kt, int64_t t) {
        for (int64_t h = 0; h < num_heads; ++h) {
            const T* kp = kt + kv_of[h] * sh;
            const float* qh = qs + h * hd;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < hd; ++d) s += qh[d] * tofloat(kp[d]);
            scores[h * len + t] = s;
        }
    });
    softmax_rows(scores, num_heads, len);
    std::fill(acc, acc + num_heads * hd, 0.f);
    walk(v, table, len, block_size, sb, st, row, true, [&](const T* vt, int64_t t) {
        for (int64_t h = 0; h < num_heads; ++h) {
            const T* vp = vt + kv_of[h] * sh;
            const float p = scores[h * len + t];
            float* a = acc + h * hd;
#pragma omp simd
            for (int64_t d = 0; d < hd; ++d) a[d] += p * tofloat(vp[d]);
        }
    });
    for (int64_t h = 0; h < num_heads; ++h)
        for (int64_t d = 0; d < hd; ++d) out[h * o_sh + d] = acc[h * hd + d];
}

// decode_one for a head size D and G query heads per kv head known at compile time, in one
// pass over the sequence's blocks with an online softmax: each block's K rows and then its V
// rows (all kv heads, contiguous) are read once, in the order they lie, while the next block's
// rows are prefetched (blocks lie anywhere in the pool, so the hardware's stream prefetchers
// start cold at each; walked kv head by kv head, a block's rows were read in three strided
// passes, 1.2x slower at batch 64: docs/benchmark-history.md); P.V goes TT tokens at a time,
// each head's accumulators in registers over them. work: heads * (2 D + 2 + block_size + VL) floats.
template <class T, int D, int G>
static void decode_fixed(const float* q, int64_t q_sh, const T* k, const T* v, int64_t sb,
                         int64_t st, int64_t sh, const int32_t* table, int64_t len, float* out,
                         int64_t o_sh, int64_t kv_heads, int64_t block_size, float scale,
                         float* work) {
    constexpr int NV = D / VL;
    constexpr int TT = 4;  // tokens per P.V tile
    const int64_t heads = kv_heads * G;
    const int64_t bp = (block_size + VL - 1) / VL * VL;
    float* acc = work;             // [heads][D]
    float* qs = acc + heads * D;   // [heads][D]: the queries, scaled
    float* mx = qs + heads * D;    // running max of each head's scores
    float* den = mx + heads;       // running sum of exp(score - max)
    float* sc = den + heads;       // [heads][bp]: scores over a block
    std::fill(acc, acc + heads * D, 0.f);
    std::fill(mx, mx + heads, -INFINITY);
    std::fill(den, den + heads, 0.f);
    for (int64_t h = 0; h < heads; ++h)
        for (int i = 0; i < NV; ++i) vstore(qs + h * D + i * VL, vload(q + h * q_sh + i * VL) * scale);
    const int64_t row_bytes = ((kv_heads - 1) * sh + D) * sizeof(T);
    const int64_t blocks = (len + block_size - 1) / block_size;
    const T* kn = k + table[0] * sb;
    const T* vn = v + table[0] * sb;
    prefetch_rows(kn, st, row_bytes, std::min(block_size, len));
    prefetch_rows(vn, st, row_bytes, std::min(block_size, len));
    for (int64_t j = 0; j < blocks; ++j) {
        const T* kb = kn;
        const T* vb = vn;
        const int64_t n = std::min(block_size, len - j * block_size);
        const bool ahead = j + 1 < blocks;
        if (ahead) {
            kn = k + table[j + 1] * sb;
            vn = v + table[j + 1] * sb;
        }
        for (int64_t t = 0; t < n; ++t) {  // Q.K^T: the block's K rows in order, every kv head
            if (ahead) {  // the next block's row t (K and V), asked for while this block's K goes by
                const char* pk = reinterpret_cast<const char*>(kn + t * st);
                const char* pv = reinterpret_cast<const char*>(vn + t * st);
                for (int64_t b = 0; b < row_bytes; b += 64) {
                    __builtin_prefetch(pk + b);
                    __builtin_prefetch(pv + b);
                }
            }
            for (int64_t kh = 0; kh < kv_heads; ++kh) {
                const T* kt = kb + t * st + kh * sh;
                vec kr[NV];
                for (int i = 0; i < NV; ++i) kr[i] = vload_kv(kt + i * VL);
                for (int g = 0; g < G; ++g) {
                    const float* qh = qs + (kh * G + g) * D;
                    vec a = vload(qh) * kr[0];
                    for (int i = 1; i < NV; ++i) a += vload(qh + i * VL) * kr[i];
                    sc[(kh * G + g) * bp + t] = hsum(a);
                }
            }
        }
        for (int64_t h = 0; h < heads; ++h) {
            float* s = sc + h * bp;
            const float m_init = s[0];  // scores past the sequence: not above its max
            for (int64_t t = n; t < bp; ++t) s[t] = m_init;
            vec mv = vload(s);
            for (int64_t i = VL; i < bp; i += VL) {
                const vec x = vload(s + i);
                mv = x > mv ? x : mv;
            }
            float m = mx[h];
            for (int i = 0; i < VL; ++i) m = std::max(m, mv[i]);
            vec sum = vec{};
            for (int64_t i = 0; i < bp; i += VL) {
                vec p = exp_neg_v(vload(s + i) - m);
                p = vload(iota) + static_cast<float>(i) < static_cast<float>(n) ? p : vec{};  // the tail past the sequence: 0
                vstore(s + i, p);
                sum += p;
            }
            const float alpha = mx[h] == -INFINITY ? 0.f : exp_neg(mx[h] - m);
            den[h] = den[h] * alpha + hsum(sum);
            mx[h] = m;
            for (int i = 0; i < NV; ++i) vstore(acc + h * D + i * VL, vload(acc + h * D + i * VL) * alpha);
        }
        for (int64_t t0 = 0; t0 < n; t0 += TT) {  // P.V: TT rows of V at a time, every kv head
            const int64_t tn = std::min<int64_t>(TT, n - t0);
            for (int64_t kh = 0; kh < kv_heads; ++kh)
                for (int g = 0; g < G; ++g) {
                    const int64_t h = kh * G + g;
                    vec a[NV];
                    for (int i = 0; i < NV; ++i) a[i] = vload(acc + h * D + i * VL);
                    for (int64_t t = t0; t < t0 + tn; ++t) {
                        const T* vt = vb + t * st + kh * sh;
                        const float p = sc[h * bp + t];
                        for (int i = 0; i < NV; ++i) a[i] += p * vload_kv(vt + i * VL);
                    }
                    for (int i = 0; i < NV; ++i) vstore(acc + h * D + i * VL, a[i]);
                }
        }
    }
    for (int64_t h = 0; h < heads; ++h) {
        const float inv = 1.f / den[h];
        for (int i = 0; i < NV; ++i) vstore(out + h * o_sh + i * VL, vload(acc + h * D + i * VL) * inv);
    }
}

// The fast path's head sizes and groups; false: decode_one.
template <class T, int D>
static bool decode_group(int64_t group, const float* q, int64_t q_sh, const T* k, const T* v,
                         int64_t sb, int64_t st, int64_t sh, const int32_t* table, int64_t len,
                         float* out, int64_t o_sh, int64_t kv_heads, int64_t block_size, float scale,
                         float* scores) {
#define FIXED(G) decode_fixed<T, D, G>(q, q_sh, k, v, sb, st, sh, table, len, out, o_sh, kv_heads, \
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

// q, out: rows indexed by q_rows[b] (row stride q_sr / o_sr, head stride q_sh / o_sh, dim 1).
// k, v: caches [num_blocks, block_size, kv_heads, head_size] of T with strides (sb, st, sh, 1).
// tables: int32 [B, table_stride]; seq_lens: int32 [B]. Sequences split over `threads`
// OpenMP threads.
template <class T>
static void decode_all(const float* q, int64_t q_sr, int64_t q_sh, const T* k, const T* v, int64_t sb,
                       int64_t st, int64_t sh, const int32_t* tables, int64_t table_stride,
                       const int32_t* seq_lens, const int64_t* q_rows, float* out, int64_t o_sr,
                       int64_t o_sh, int64_t num_heads, int64_t kv_heads, int64_t head_size,
                       int64_t block_size, float scale, int64_t work, int64_t threads) {
    const int64_t group = num_heads / kv_heads;
#pragma omp parallel num_threads(threads)
    {
    std::vector<float> scores, qs(num_heads * head_size), acc(num_heads * head_size);
    const int64_t fixed_work = num_heads * (2 * head_size + 2 + block_size + 16);
#pragma omp for schedule(dynamic, 1)
    for (int64_t b = 0; b < work; ++b) {
        const int64_t len = seq_lens[b];
        scores.resize(std::max(num_heads * len, fixed_work));
        const float* qb = q + q_rows[b] * q_sr;
        float* ob = out + q_rows[b] * o_sr;
        const int32_t* table = tables + b * table_stride;
        const bool fixed =
            head_size == 64 ? decode_group<T, 64>(group, qb, q_sh, k, v, sb, st, sh, table, len, ob, o_sh,
                                                  kv_heads, block_size, scale, scores.data())
            : head_size == 128 ? decode_group<T, 128>(group, qb, q_sh, k, v, sb, st, sh, table, len, ob,
                                                      o_sh, kv_heads, block_size, scale, scores.data())
            : false;
        if (!fixed)
            decode_one(qb, q_sh, k, v, sb, st, sh, table, len, ob, o_sh, num_heads, group, head_size,
                       block_size, scale, qs.data(), scores.data(), acc.data());
    }
    }
}

extern "C" {

#define DECODE_ARGS(T) const float* q, int64_t q_sr, int64_t q_sh, const T* k, const T* v, int64_t sb, \
    int64_t st, int64_t sh, const int32_t* tables, int64_t table_stride, const int32_t* seq_lens, \
    const int64_t* q_rows, float* out, int64_t o_sr, int64_t o_sh, int64_t num_heads, int64_t kv_heads, \
    int64_t head_size, int64_t block_size, float scale, int64_t work, int64_t threads
#define DECODE_CALL q, q_sr, q_sh, k, v, sb, st, sh, tables, table_stride, seq_lens, q_rows, out, o_sr, \
    o_sh, num_heads, kv_heads, head_size, block_size, scale, work, threads

void paged_decode_f32(DECODE_ARGS(float)) { decode_all(DECODE_CALL); }
// K/V in bfloat16 (their uint16_t bits), q and out float32, arithmetic in float32.
void paged_decode_bf16(DECODE_ARGS(uint16_t)) { decode_all(DECODE_CALL); }

}  // extern "C"
"""


def _build() -> ctypes.CDLL | None:
    lib = native_build.load("paged_attention_cpu", SOURCE)
    if lib is not None:
        set_argtypes(lib)
    return lib


def set_argtypes(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for name in ("paged_decode_f32", "paged_decode_bf16"):
        f = getattr(lib, name, None)
        if f is not None:
            f.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, i64, ptr, i64, ptr, ptr, ptr, i64, i64,
                          i64, i64, i64, i64, ctypes.c_float, i64, i64]  # ..., work, threads
            f.restype = None


_native = native_build.Library(_build)


def native_available() -> bool:
    """Whether the C++ decode kernel is built and loaded (builds it on first call)."""
    return _native.get() is not None


def _threads(work: int) -> int:
    return max(1, min(torch.get_num_threads(), work // 8 or 1))


def paged_decode(q, k_cache, v_cache, block_tables, seq_lens, rows, scale, out) -> None:
    """Decode attention for the sequences whose single query sits at q[rows[b]], written to
    out[rows[b]]. q and out float32, the k/v caches float32 or bfloat16 (read as float32),
    CPU tensors, each with a contiguous last dimension."""
    assert q.dtype == out.dtype == torch.float32 and k_cache.dtype in (torch.float32, torch.bfloat16)
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
    lib = _native.get()
    kernel = lib.paged_decode_bf16 if k_cache.dtype == torch.bfloat16 else lib.paged_decode_f32
    kernel(*args, work, _threads(work * kv_heads))
