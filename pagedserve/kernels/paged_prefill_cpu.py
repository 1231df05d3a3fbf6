"""The prefill attention kernel of the CPU path, in C++: every prompt chunk of a step in one
call, float32, reading each sequence's K/V in place from its blocks of the pool.

paged_prefill(q, k_cache, v_cache, block_tables, chunks, items, scale, out): `chunks` [n, 4]
int64 rows (b, start, end, length): the queries q[start:end] of sequence b, whose context is
`length` tokens (the last end - start of them are the chunk's own; those before, its cached
prefix), attend causally over block_tables[b]; any chunk length. Work items (work_items) are
tiles of 48 rows (24 on AVX2) of a chunk's (query, head) pairs for one kv head, on torch's
OpenMP threads, the GIL released (ctypes). A tile is register-tiled like a small GEMM: its
queries held transposed, Q.K^T and P.V computed as micro-kernels whose accumulators stay in
vector registers while each K and V row is read once for the whole tile, with an online
softmax down the rows, 64 keys a step; keys past every row's position are never computed.
Built as pagedserve/kernels/paged_decode_cpu.py is (pagedserve/kernels/native_build.py;
AVX-512 or AVX2 as -march gives); tested against the torch reference through
pagedserve/kernels/paged_cpu.py (tests/unit/kernels/test_kernels_cpu.py,
tests/unit/kernels/test_prefill_cpu.py; the AVX2 build in
tests/integration/test_prefill_cpu_avx2.py); measured by scripts/bench_prefill_cpu.py.
"""
from __future__ import annotations

import ctypes

import torch

from pagedserve.kernels import native_build
from pagedserve.kernels.paged_decode_cpu import EXP_NEG, VEC

SOURCE = EXP_NEG + VEC + r"""
// Prefill attention over the paged KV pool: causal, each chunk after its cached prefix.
// A tile is M rows (query, head of the kv head's group), held transposed: qt[d][m], so that
// a vector spans M / MV rows and the softmax over a key runs down the rows, lane by lane.
// MV vectors of rows; NR keys per step of Q.K^T and DR value columns per step of P.V: their
// accumulators (NR * MV, DR * MV vectors) stay in registers (32 on AVX-512, 16 below).
#define MV 3  // 3 better than 2 or 4 (tiles of 48 rows on AVX-512, 24 on AVX2: docs/benchmark-history.md)
#if VL == 16
#define NR 8
#define DR 8
#else
#define NR 4
#define DR 4
#endif
#define M (MV * VL)
// A loaded vector kept in a register: below AVX-512 the 12 accumulators leave 4 of 16, and GCC
// otherwise folds the load into each of the NR (DR) FMAs that use it, 16 loads for 12 FMAs
// (1.15-1.3x slower on AVX2: docs/benchmark-history.md); not measured on AVX-512, so left alone there.
static inline vec pin(vec x) {
#if VL < 16
    asm("" : "+x"(x));
#endif
    return x;
}
#define PIN(x) pin(x)
#define NK 64  // keys per online-softmax step (a multiple of NR)

// Scores of NR keys (rows kp[0..NR)) against the tile: s[n][m] = sum_d k_n[d] qt[d][m]; keys
// past a row's position (key0 + n > pos) are -inf when `mask`; mx: the running max per row.
// Vectors of rows below V0 lie wholly before key0 (rows go by position): -inf, not computed.
template <int V0>
static inline void scores_nr(const float* qt, const float* const* kp, int64_t D, float key0, bool mask,
                             const vec* pos, vec* mx, float* s) {
    vec a[NR][MV] = {};
    for (int64_t d = 0; d < D; ++d) {
        vec qv[MV];
        for (int i = V0; i < MV; ++i) qv[i] = PIN(vload(qt + d * M + i * VL));
        for (int n = 0; n < NR; ++n) {
            const float kd = kp[n][d];
            for (int i = V0; i < MV; ++i) a[n][i] += qv[i] * kd;
        }
    }
    const vec ninf = vec{} - INFINITY;
    for (int n = 0; n < NR; ++n)
        for (int i = 0; i < MV; ++i) {
            vec x = i < V0 ? ninf : a[n][i];
            if (mask) x = pos[i] < key0 + n ? ninf : x;
            mx[i] = x > mx[i] ? x : mx[i];
            vstore(s + n * M + i * VL, x);
        }
}

// scores_nr<v0> for a v0 known at run time (below MV).
template <int V>
static inline void scores_from(int v0, const float* qt, const float* const* kp, int64_t D, float key0,
                               bool mask, const vec* pos, vec* mx, float* s) {
    if constexpr (V + 1 < MV) {
        if (v0 > V) return scores_from<V + 1>(v0, qt, kp, D, key0, mask, pos, mx, s);
    }
    scores_nr<V>(qt, kp, D, key0, mask, pos, mx, s);
}

// a[r][i] += sum_n v_n[d0 + r] p[n][i-th vector] over the keys seg[V] .. seg[V + 1] - 1, whose
// probabilities are 0 for the vectors of rows below V; then the next segment.
template <int R, int V>
static inline void pv_segments(vec (&a)[R][MV], const float* p, const float* const* vp, const int64_t* seg,
                               int64_t d0) {
    for (int64_t n = seg[V]; n < seg[V + 1]; ++n) {
        vec pn[MV];
        for (int i = V; i < MV; ++i) pn[i] = PIN(vload(p + n * M + i * VL));
        const float* vr = vp[n] + d0;
        for (int r = 0; r < R; ++r) {
            const float vd = vr[r];
            for (int i = V; i < MV; ++i) a[r][i] += pn[i] * vd;
        }
    }
    if constexpr (V + 1 < MV) pv_segments<R, V + 1>(a, p, vp, seg, d0);
}

// ot[d][m] = alpha[m] ot[d][m] + sum_n v_n[d] p[n][m] for R value columns from d0.
template <int R>
static inline void pv_cols(const float* p, const float* const* vp, const int64_t* seg, int64_t d0,
                           const vec* alpha, float* ot) {
    vec a[R][MV];
    for (int r = 0; r < R; ++r)
        for (int i = 0; i < MV; ++i) a[r][i] = vload(ot + (d0 + r) * M + i * VL) * alpha[i];
    pv_segments<R, 0>(a, p, vp, seg, d0);
    for (int r = 0; r < R; ++r)
        for (int i = 0; i < MV; ++i) vstore(ot + (d0 + r) * M + i * VL, a[r][i]);
}

// VL vectors transposed in place (r[i][j] <-> r[j][i]): log2(VL) stages, stage s exchanging
// bit h = VL >> (s + 1) of the row index with that bit of the lane index, two shuffles per pair
// of rows (their lane indices into the pair, made at compile time: else built lane by lane).
struct ShuffleMasks {
    int32_t lo[4][16], hi[4][16];
};
static constexpr ShuffleMasks shuffle_masks() {
    ShuffleMasks t{};
    for (int s = 0; VL >> (s + 1) >= 1; ++s) {
        const int h = VL >> (s + 1);
        for (int j = 0; j < VL; ++j) {
            t.lo[s][j] = (j & h) ? VL + j - h : j;
            t.hi[s][j] = (j & h) ? VL + j : j + h;
        }
    }
    return t;
}
static constexpr ShuffleMasks masks = shuffle_masks();
static inline void transpose(vec* r) {
#pragma GCC unroll 4
    for (int s = 0; VL >> (s + 1) >= 1; ++s) {
        const int h = VL >> (s + 1);
        ivec lo, hi;
        __builtin_memcpy(&lo, masks.lo[s], sizeof lo);
        __builtin_memcpy(&hi, masks.hi[s], sizeof hi);
#pragma GCC unroll 16
        for (int i = 0; i < VL; ++i)
            if (!(i & h)) {
                const vec a = r[i], c = r[i + h];
                r[i] = __builtin_shuffle(a, c, lo);
                r[i + h] = __builtin_shuffle(a, c, hi);
            }
    }
}

// One tile: rows first .. first + rows - 1 of a chunk (row r: query r / group of the chunk,
// head kvh * group + r % group), its queries at positions pos0 + r / group; keys 0 .. the last
// row's position, NK at a time, each K and V row read once for the whole tile.
// work: 2 * D * M + NK * M floats, 2 * NK pointers.
static void prefill_tile(const float* q, int64_t q_st, int64_t q_sh, const float* k, const float* v,
                         int64_t sb, int64_t st, int64_t sh, const int32_t* table, int64_t qrow0,
                         int64_t first, int64_t rows, int64_t pos0, float* out, int64_t o_st, int64_t o_sh,
                         int64_t kvh, int64_t group, int64_t D, int64_t bs, float scale, float* work,
                         const float** kp) {
    float* qt = work;
    float* ot = qt + D * M;
    float* sc = ot + D * M;
    const float** vp = kp + NK;
    const float* src[M];  // each row's query; rows past the chunk: copies of the last
    float posf[M];
    for (int64_t m = 0; m < M; ++m) {
        const int64_t r = first + std::min<int64_t>(m, rows - 1);
        src[m] = q + (qrow0 + r / group) * q_st + (kvh * group + r % group) * q_sh;
        posf[m] = static_cast<float>(pos0 + r / group);
    }
    if (D % VL == 0) {
        for (int64_t m0 = 0; m0 < M; m0 += VL)
            for (int64_t d0 = 0; d0 < D; d0 += VL) {
                vec t[VL];
                for (int i = 0; i < VL; ++i) t[i] = vload(src[m0 + i] + d0) * scale;
                transpose(t);
                for (int i = 0; i < VL; ++i) vstore(qt + (d0 + i) * M + m0, t[i]);
            }
    } else {
        for (int64_t m = 0; m < M; ++m)
            for (int64_t d = 0; d < D; ++d) qt[d * M + m] = src[m][d] * scale;
    }
    std::fill(ot, ot + D * M, 0.f);
    vec pos[MV], mrun[MV], lrun[MV];
    int64_t last_pos[MV];  // the last position of each vector's rows
    for (int i = 0; i < MV; ++i) {
        last_pos[i] = static_cast<int64_t>(posf[i * VL + VL - 1]);
        pos[i] = vload(posf + i * VL);
        mrun[i] = vec{} - INFINITY;
        lrun[i] = vec{};
    }
    const int64_t lo = pos0 + first / group, hi = pos0 + (first + rows - 1) / group;
    const int64_t koff = kvh * sh;
    for (int64_t base = 0; base <= hi; base += NK) {
        // this step's K and V rows, NR at a time: those past the last row's position repeat its
        // last key's (never read past the context), masked
        const int64_t cnt = std::min<int64_t>(NK, (hi + 1 - base + NR - 1) / NR * NR);
        for (int64_t n = 0, j = base / bs, t = base % bs; n < cnt; ++n) {
            if (base + n > hi) {
                kp[n] = kp[n - 1];
                vp[n] = vp[n - 1];
                continue;
            }
            const int64_t off = static_cast<int64_t>(table[j]) * sb + t * st + koff;
            kp[n] = k + off;
            vp[n] = v + off;
            if (++t == bs) t = 0, ++j;
        }
        const bool mask = base + cnt - 1 > lo;  // a key past some row's position
        vec mx[MV];
        for (int i = 0; i < MV; ++i) mx[i] = vec{} - INFINITY;
        // seg[v]: the first key from which the vectors of rows below v lie wholly before each
        // group of NR keys (rows go by position, so v0 only grows)
        int64_t seg[MV + 1];
        seg[0] = 0;
        int v0 = 0;
        for (int64_t n = 0; n < cnt; n += NR) {
            while (mask && v0 + 1 < MV && last_pos[v0] < base + n) seg[++v0] = n;
            scores_from<0>(v0, qt, kp + n, D, static_cast<float>(base + n), mask, pos, mx, sc + n * M);
        }
        for (int v = v0 + 1; v <= MV; ++v) seg[v] = cnt;
        vec alpha[MV], sum[MV];
        for (int i = 0; i < MV; ++i) {  // every row sees key 0, in the first step: mrun finite after it
            const vec mn = mx[i] > mrun[i] ? mx[i] : mrun[i];
            alpha[i] = exp_neg_v(mrun[i] - mn);
            mrun[i] = mn;
            sum[i] = vec{};
        }
        for (int64_t n = 0; n < cnt; ++n)
            for (int i = 0; i < MV; ++i) {
                const vec x = vload(sc + n * M + i * VL);
                vec p = exp_neg_v(x - mrun[i]);
                if (mask) p = x == vec{} - INFINITY ? vec{} : p;
                sum[i] += p;
                vstore(sc + n * M + i * VL, p);
            }
        for (int i = 0; i < MV; ++i) lrun[i] = lrun[i] * alpha[i] + sum[i];
        int64_t d0 = 0;
        for (; d0 + DR <= D; d0 += DR) pv_cols<DR>(sc, vp, seg, d0, alpha, ot);
        for (; d0 < D; ++d0) pv_cols<1>(sc, vp, seg, d0, alpha, ot);
    }
    float inv[M];
    for (int i = 0; i < MV; ++i) vstore(inv + i * VL, 1.f / lrun[i]);
    float* dst[M];
    for (int64_t m = 0; m < rows; ++m) {
        const int64_t r = first + m;
        dst[m] = out + (qrow0 + r / group) * o_st + (kvh * group + r % group) * o_sh;
    }
    if (D % VL == 0) {
        for (int64_t m0 = 0; m0 < rows; m0 += VL)
            for (int64_t d0 = 0; d0 < D; d0 += VL) {
                vec t[VL];
                for (int i = 0; i < VL; ++i) t[i] = vload(ot + (d0 + i) * M + m0);
                transpose(t);
                for (int i = 0; i < VL && m0 + i < rows; ++i) vstore(dst[m0 + i] + d0, t[i] * inv[m0 + i]);
            }
    } else {
        for (int64_t m = 0; m < rows; ++m)
            for (int64_t d = 0; d < D; ++d) dst[m][d] = ot[d * M + m] * inv[m];
    }
}

extern "C" {

// Rows (query, head) of a work item.
int64_t paged_prefill_tile_rows() { return M; }

// chunks: n_chunks rows of (b, start, end, length); items: n_items rows of (chunk, first row,
// kv head), a chunk's rows being (end - start) * group.
void paged_prefill_f32(const float* q, int64_t q_st, int64_t q_sh, const float* k, const float* v,
                       int64_t sb, int64_t st, int64_t sh, const int32_t* tables, int64_t table_stride,
                       const int64_t* chunks, const int64_t* items, int64_t n_items, float* out,
                       int64_t o_st, int64_t o_sh, int64_t num_heads, int64_t kv_heads, int64_t head_size,
                       int64_t block_size, float scale, int64_t threads) {
    const int64_t group = num_heads / kv_heads;
#pragma omp parallel num_threads(threads)
    {
    std::vector<float> work((2 * head_size + NK) * M);
    std::vector<const float*> kp(2 * NK);
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < n_items; ++w) {
        const int64_t* c = chunks + items[3 * w] * 4;
        const int64_t b = c[0], start = c[1], end = c[2], length = c[3];
        const int64_t first = items[3 * w + 1], kvh = items[3 * w + 2];
        const int64_t rows = std::min<int64_t>(M, (end - start) * group - first);
        prefill_tile(q, q_st, q_sh, k, v, sb, st, sh, tables + b * table_stride, start, first, rows,
                     length - (end - start), out, o_st, o_sh, kvh, group, head_size, block_size, scale,
                     work.data(), kp.data());
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
                  i64, i64, ctypes.c_float, i64]
    f.restype = None
    lib.paged_prefill_tile_rows.argtypes = []
    lib.paged_prefill_tile_rows.restype = i64
    return lib


_native = native_build.Library(_build)


def native_available() -> bool:
    """Whether the C++ prefill kernel is built and loaded (builds it on first call)."""
    return _native.get() is not None


def work_items(chunks: list[tuple[int, int, int, int]], kv_heads: int, group: int) -> torch.Tensor:
    """(chunk, first row, kv head) per work item, int64 [n, 3], a chunk's rows being its
    (query, head of the group) pairs, the kernel's tile of them at a time; the most keys
    first (the dynamic schedule then ends even). The same for every layer."""
    tile = _native.get().paged_prefill_tile_rows()
    items = [(h, c, -(length - (end - start) + min(first + tile, (end - start) * group) // group), c, first, h)
             for c, (_, start, end, length) in enumerate(chunks)
             for first in range(0, (end - start) * group, tile) for h in range(kv_heads)]
    items.sort()
    return torch.tensor([item[3:] for item in items], dtype=torch.int64).reshape(-1, 3)


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
        out.stride(0), out.stride(1), num_heads, kv_heads, head_size, block_size, float(scale), threads)
