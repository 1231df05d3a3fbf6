"""y = x @ weight.T (+ bias) in C++ on the weight as stored, for the CPU float32 linear layers.

matmul(x [M, K], weight [N, K], bias) -> [M, N]: each output is a dot product over K, in tiles
of 4 rows of x by 3 rows of the weight (twelve accumulators in registers), 16 lanes at a time
where the target has AVX-512, else 8 (on an AMD EPYC 26/2, 64 rows: 231-247 -> 309-387
GFLOP/s, BENCHMARKS.md, issue 44), the weight walked in blocks of BLOCK rows split over
OpenMP threads (a thread done early takes the rest of another's share: pagedserve/kernels/block_split_cpu.py), each
block read once and used for every row of x, four rows at a time (K cut in chunks of at most
MAX_K). It needs no copy of the weight: a layer routed
here and to MKL (F.linear) holds one dense weight, where oneDNN holds its own packed copy.
Measured on the default model's shapes it is faster than both at a decode's few rows and at
a decode batch, and level with MKL at 512 rows (BENCHMARKS.md, issue 44; the panel kernel on
its own copy, pagedserve/kernels/panel_cpu.py, is faster at a batch); `--linear-backend
auto` times it beside them (pagedserve.executor.linear_timing). matmul_silu(x, gate_up weight)
is the same walk over a gate/up weight that applies SiLU-and-multiply to each block's sums
(pagedserve/kernels/silu_row_cpu.py), so the projection's [M, 2H] output is never written.
unavailable(weight) is None for float32 on the CPU, K a multiple of 8, the library built
(pagedserve/kernels/native_build.py); tested against F.linear in tests/unit/kernels/test_linear_cpu.py.
"""
from __future__ import annotations

import ctypes
import hashlib

import torch

from pagedserve.kernels import block_split_cpu, native_build, silu_row_cpu

SOURCE = silu_row_cpu.SOURCE + block_split_cpu.SOURCE + r"""
// y[m][n] = sum_k x[m][k] * w[n][k] (+ b[n]), float32, K % 8 == 0.
// Built by pagedserve/kernels/linear_cpu.py (pagedserve/kernels/native_build.py); plain C ABI.
#include <cstdint>
#include <cstring>
#include <type_traits>

constexpr int PREFETCH_LINES = 8;

typedef float v8 __attribute__((vector_size(32)));
typedef int vi8 __attribute__((vector_size(32)));
#if defined(__clang__)
#define SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUF(a, b, ...) __builtin_shuffle(a, b, (vi8){__VA_ARGS__})
#endif

// The vectors of a tile of 4 rows of x: 16 lanes where the target has AVX-512 (its 32 vector
// registers hold them), else 8. A one-row tile waits on memory: 8 lanes (16 measured 5-10% slower).
#if defined(__AVX512F__)
typedef float v16 __attribute__((vector_size(64)));
typedef v16 vrows;
#define KEEP(v) asm("" : "+v"(v))
#define TILE __attribute__((noinline)) static  // inlined in the gated kernel it spilled 624 vectors
static inline v8 fold(v16 v) { v8 lo, hi; memcpy(&lo, &v, 32); memcpy(&hi, (const char*)&v + 32, 32); return lo + hi; }
#else
typedef v8 vrows;
#define KEEP(v) asm("" : "+x"(v))
#define TILE static inline  // (a call per tile cost 8-12% at 64 rows on AVX2)
#endif
static inline v8 fold(v8 v) { return v; }
template <class V> static inline V loadv(const float* p) { V v; memcpy(&v, p, sizeof v); return v; }
template <class V> static inline V load_low8(const float* p) { V v = {}; memcpy(&v, p, 32); return v; }  // upper lanes 0

// lane i of the result: the sum of the lanes of v_i
static inline v8 sums8(v8 v0, v8 v1, v8 v2, v8 v3, v8 v4, v8 v5, v8 v6, v8 v7) {
  v8 a0 = SHUF(v0, v1, 0, 8, 2, 10, 4, 12, 6, 14) + SHUF(v0, v1, 1, 9, 3, 11, 5, 13, 7, 15);
  v8 a1 = SHUF(v2, v3, 0, 8, 2, 10, 4, 12, 6, 14) + SHUF(v2, v3, 1, 9, 3, 11, 5, 13, 7, 15);
  v8 a2 = SHUF(v4, v5, 0, 8, 2, 10, 4, 12, 6, 14) + SHUF(v4, v5, 1, 9, 3, 11, 5, 13, 7, 15);
  v8 a3 = SHUF(v6, v7, 0, 8, 2, 10, 4, 12, 6, 14) + SHUF(v6, v7, 1, 9, 3, 11, 5, 13, 7, 15);
  v8 b0 = SHUF(a0, a1, 0, 1, 8, 9, 4, 5, 12, 13) + SHUF(a0, a1, 2, 3, 10, 11, 6, 7, 14, 15);
  v8 b1 = SHUF(a2, a3, 0, 1, 8, 9, 4, 5, 12, 13) + SHUF(a2, a3, 2, 3, 10, 11, 6, 7, 14, 15);
  return SHUF(b0, b1, 0, 1, 2, 3, 8, 9, 10, 11) + SHUF(b0, b1, 4, 5, 6, 7, 12, 13, 14, 15);
}

// MR rows of x by NR rows of w; the empty asm statements keep each loaded vector in a
// register (else the compiler folds the weight's loads into every FMA: 16 loads for 12 FMAs)
template <int MR, int NR, class V = typename std::conditional<MR == 1, v8, vrows>::type>
TILE void tile(const float* x, int64_t sx, const float* w, int64_t sw, int64_t K,
               const float* b, float* y, int64_t sy, bool add) {
  constexpr int64_t VW = sizeof(V) / sizeof(float);
  V acc[MR * NR] = {};
  int64_t k = 0;
#pragma GCC unroll 4
  for (; VW == 8 ? k < K : k + VW <= K; k += VW) {  // K % 8 == 0 (each form as it compiles fastest)
    V wv[NR];
    for (int j = 0; j < NR; j++) { wv[j] = loadv<V>(w + j * sw + k); KEEP(wv[j]); }
    for (int i = 0; i < MR; i++) {
      V a = loadv<V>(x + i * sx + k);
      KEEP(a);
      for (int j = 0; j < NR; j++) acc[i * NR + j] += a * wv[j];
    }
  }
  if (VW > 8 && k < K) {  // K % 16 == 8: one half step, the upper lanes zero
    V wv[NR];
    for (int j = 0; j < NR; j++) wv[j] = load_low8<V>(w + j * sw + k);
    for (int i = 0; i < MR; i++) {
      V a = load_low8<V>(x + i * sx + k);
      for (int j = 0; j < NR; j++) acc[i * NR + j] += a * wv[j];
    }
  }
  float out[16];
  const auto put = [&](const v8* h) {
    const v8 z = {};
    for (int t = 0; t < MR * NR; t += 8) {
      v8 s = sums8(h[t], t + 1 < MR * NR ? h[t + 1] : z, t + 2 < MR * NR ? h[t + 2] : z,
                   t + 3 < MR * NR ? h[t + 3] : z, t + 4 < MR * NR ? h[t + 4] : z,
                   t + 5 < MR * NR ? h[t + 5] : z, t + 6 < MR * NR ? h[t + 6] : z,
                   t + 7 < MR * NR ? h[t + 7] : z);
      memcpy(out + t, &s, 32);
    }
  };
  if constexpr (sizeof(V) == sizeof(v8)) {
    put(acc);
  } else {  // each sum's 16 lanes folded to 8 first
    v8 h[MR * NR];
    for (int t = 0; t < MR * NR; t++) h[t] = fold(acc[t]);
    put(h);
  }
  for (int i = 0; i < MR; i++)
    for (int j = 0; j < NR; j++) y[i * sy + j] = (add ? y[i * sy + j] : 0.0f) + out[i * NR + j] + (b ? b[j] : 0.0f);
}

// rows m..m+MR of x by weight rows n..n+nr (nr < 3 only at a block's end); before each tile,
// PREFETCH_LINES more cache lines of the thread's next block (pf up to pf_end) are asked for, so
// that block streams in from memory while this one computes (else the weight's first pass
// waits on memory: 7% of a decode batch's matmul time, BENCHMARKS.md, issue 44)
template <int MR>
static inline void tiles(const float* x, int64_t sx, const float* w, int64_t sw, int64_t K, const float* b,
                         float* y, int64_t sy, int64_t n0, int64_t n1, bool add, const float*& pf,
                         const float* pf_end) {
  int64_t n = n0;
  for (; n + 3 <= n1; n += 3) {
    for (int q = 0; q < PREFETCH_LINES && pf < pf_end; q++, pf += 16) __builtin_prefetch(pf, 0, 3);
    tile<MR, 3>(x, sx, w + n * sw, sw, K, b ? b + n : b, y + n, sy, add);
  }
  if (n1 - n == 2) tile<MR, 2>(x, sx, w + n * sw, sw, K, b ? b + n : b, y + n, sy, add);
  if (n1 - n == 1) tile<MR, 1>(x, sx, w + n * sw, sw, K, b ? b + n : b, y + n, sy, add);
}

extern "C" void linear_f32(const float* x, int64_t sx, const float* w, const float* b, float* y,
                           int64_t M, int64_t N, int64_t K, int64_t block, int64_t max_k,
                           int64_t threads) {
  const int64_t chunks = (K + max_k - 1) / max_k, kc = ((K + chunks - 1) / chunks + 7) / 8 * 8;
  split_blocks((N + block - 1) / block, threads, [&](int64_t blk, bool more) {
    const int64_t n0 = blk * block, n1 = (blk + 1) * block < N ? (blk + 1) * block : N;
    const float* pf = w + n1 * K;  // the next block of this thread's range
    const float* pf_end = more ? w + (n1 + block < N ? n1 + block : N) * K : pf;
    for (int64_t k0 = 0; k0 < K; k0 += kc) {
      const int64_t kn = K - k0 < kc ? K - k0 : kc;
      const float* bk = k0 ? nullptr : b;
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) tiles<4>(x + m * sx + k0, sx, w + k0, K, kn, bk, y + m * N, N, n0, n1, k0 > 0, pf, pf_end);
      for (; m < M; m++) tiles<1>(x + m * sx + k0, sx, w + k0, K, kn, bk, y + m * N, N, n0, n1, k0 > 0, pf, pf_end);
    }
  });
}

constexpr int64_t GATED_ROWS = 32;  // rows of x per pass over a block: their sums fit a scratch on the stack
constexpr int64_t MAX_HALF = 48;

// y[m][j] = silu(g) * u (row stride sy), g and u the sums of x[m] with weight rows j and H + j of
// w [2H, K] (gate rows, then up rows). A block is half a linear_f32 block of gate rows and as
// many up rows (the same weight in L2); their sums go to a scratch laid out as a gate/up row.
extern "C" void linear_silu_f32(const float* x, int64_t sx, const float* w, float* y, int64_t sy,
                                int64_t M, int64_t H, int64_t K, int64_t block, int64_t max_k,
                                int64_t threads) {
  const int64_t half = block / 2;
  const int64_t chunks = (K + max_k - 1) / max_k, kc = ((K + chunks - 1) / chunks + 7) / 8 * 8;
  split_blocks((H + half - 1) / half, threads, [&](int64_t blk, bool more) {
    const int64_t n0 = blk * half, n1 = n0 + half < H ? n0 + half : H, nb = n1 - n0;
    const int64_t next = more ? (n1 + half < H ? n1 + half : H) : n1;
    const float *wg = w + n0 * K, *wu = w + (H + n0) * K;
    const float *pg = w + n1 * K, *pg_end = w + next * K;  // the next block's gate and up rows
    const float *pu = w + (H + n1) * K, *pu_end = w + (H + next) * K;
    float s[GATED_ROWS * 2 * MAX_HALF];
    const int64_t ss = 2 * half;  // the scratch's row: half gate sums, then half up sums
    for (int64_t m0 = 0; m0 < M; m0 += GATED_ROWS) {
      const int64_t mr = M - m0 < GATED_ROWS ? M - m0 : GATED_ROWS;
      const float* xm = x + m0 * sx;
      for (int64_t k0 = 0; k0 < K; k0 += kc) {
        const int64_t kn = K - k0 < kc ? K - k0 : kc;
        const float *gk = wg + k0, *uk = wu + k0;
        int64_t m = 0;
        for (; m + 4 <= mr; m += 4) {
          tiles<4>(xm + m * sx + k0, sx, gk, K, kn, nullptr, s + m * ss, ss, 0, nb, k0 > 0, pg, pg_end);
          tiles<4>(xm + m * sx + k0, sx, uk, K, kn, nullptr, s + m * ss + half, ss, 0, nb, k0 > 0, pu, pu_end);
        }
        for (; m < mr; m++) {
          tiles<1>(xm + m * sx + k0, sx, gk, K, kn, nullptr, s + m * ss, ss, 0, nb, k0 > 0, pg, pg_end);
          tiles<1>(xm + m * sx + k0, sx, uk, K, kn, nullptr, s + m * ss + half, ss, 0, nb, k0 > 0, pu, pu_end);
        }
      }
      for (int64_t m = 0; m < mr; m++) silu_mul_row(s + m * ss, s + m * ss + half, y + (m0 + m) * sy + n0, nb);
    }
  });
}
"""
VERSION = hashlib.sha256(SOURCE.encode()).hexdigest()[:8]  # kept timings of another build are not used
BLOCK = 48  # weight rows per block (a multiple of 3): 48 x 576 floats is 110 KB, within L2
MAX_K = 768  # K longer than this is cut in even chunks, the sums added into y: a tile's rows
# of x and of the weight then stay in L1 (down's K of 1,536 in two: 1.07x at 64 rows, 1.2x at 512)


def _build() -> ctypes.CDLL | None:
    lib = native_build.load("linear_cpu", SOURCE)
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.linear_f32.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64]
    lib.linear_f32.restype = None
    lib.linear_silu_f32.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, i64, i64]
    lib.linear_silu_f32.restype = None
    return lib


_native = native_build.Library(_build)


def available() -> bool:
    """Whether the kernel is built and loaded (builds it on first call)."""
    return _native.get() is not None


def unavailable_for(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why this kernel cannot serve weights of `dtype` on `device`, or None."""
    return _native.float32_cpu("the C++ linear kernel", device, dtype)


def unavailable(weight: torch.Tensor) -> str | None:
    """Why this kernel cannot multiply by `weight`, or None."""
    if weight.dim() != 2 or weight.shape[1] % 8 or not weight.is_contiguous():
        return (f"the C++ linear kernel takes a contiguous [N, K] weight with K a multiple of 8 "
                f"({list(weight.shape)})")
    return unavailable_for(weight.device, weight.dtype)


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (unit stride along K) @ weight.T, + bias [N] if given, into a new [M, N]
    tensor; weight as unavailable() accepts it."""
    m, k = x.shape
    n = weight.shape[0]
    assert x.dtype == torch.float32 and x.stride(1) == 1 and weight.shape[1] == k
    assert bias is None or (bias.is_contiguous() and bias.shape == (n,))
    y = torch.empty(m, n)
    if m:
        threads = max(1, min(torch.get_num_threads(), -(-n // BLOCK)))
        _native.get().linear_f32(x.data_ptr(), x.stride(0), weight.data_ptr(),
                                 None if bias is None else bias.data_ptr(), y.data_ptr(), m, n, k, BLOCK, MAX_K, threads)
    return y


def matmul_silu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up into a new [M, N/2] tensor, where [gate | up] = x [M, K] (unit stride along
    K) @ weight.T and weight [N, K] holds the gate rows then the up rows, as unavailable()
    accepts it: the gate/up projection with SiLU-and-multiply applied to its sums as each block
    ends, so its [M, N] output is never written (pagedserve/kernels/silu_row_cpu.py)."""
    m, k = x.shape
    half = weight.shape[0] // 2
    assert x.dtype == torch.float32 and x.stride(1) == 1 and weight.shape == (2 * half, k)
    y = torch.empty(m, half)
    if m:
        threads = max(1, min(torch.get_num_threads(), -(-half // (BLOCK // 2))))
        _native.get().linear_silu_f32(x.data_ptr(), x.stride(0), weight.data_ptr(), y.data_ptr(), half,
                                      m, half, k, BLOCK, MAX_K, threads)
    return y
