"""y = x @ weight.T (+ bias) in C++ on a copy of the weight packed in column panels, for the CPU
float32 linear layers ("panel" in pagedserve.executor.linear).

pack(weight [N, K]) -> PanelWeight: panels of P rows of the weight, each stored K-major (P = 64
where the target has AVX-512, else 16): P/2 rows from the first half of the weight and the P/2
matching ones of the second half, so that a gate/up weight's panel holds gate and up side by
side. matmul(x [M, K], packed, bias) -> [M, N]: each tile of 6 rows of x by one panel keeps its
6 x P sums in registers, one weight vector load per 6 FMAs and x broadcast from memory: no
horizontal sums, unlike the dot-product kernel on the dense weight (pagedserve/kernels/linear_cpu.py).
matmul_silu(x, packed gate/up) -> [M, N/2] applies SiLU-and-multiply to each tile's sums
(pagedserve/kernels/silu_row_cpu.py): the projection's [M, N] output is never written.
Panels (and, where they do not split evenly over the threads, halves of the rows) are split over
OpenMP threads (pagedserve/kernels/block_split_cpu.py); while one panel computes, its thread asks
for the next panel's cache lines, one per K step, so a weight read from memory (a decode step
streams every weight of the model) arrives as it is needed. K is cut in chunks of at most
MAX_K, the sums added into y (not for matmul_silu).
On an AMD EPYC 26/2, 64 rows, each of 30 layers its own weight: 446-487 GFLOP/s where oneDNN's
prepacked weight gives 324-431 (BENCHMARKS.md, issue 44). unavailable(weight) is None for a 2-D
float32 weight on the CPU with the library built (pagedserve/kernels/native_build.py); tested
against F.linear in tests/unit/kernels/test_panel_cpu.py.
"""
from __future__ import annotations

import ctypes
import hashlib
from dataclasses import dataclass

import torch

from pagedserve.kernels import block_split_cpu, native_build, silu_row_cpu

SOURCE = silu_row_cpu.SOURCE + block_split_cpu.SOURCE + r"""
// y = x @ w.T (+ b), float32, w packed by pagedserve/kernels/panel_cpu.py: panel p holds, K-major,
// the P/2 rows of w from p * P/2 and the P/2 from H + p * P/2 (H = ceil(N / 2)), zero past N.
// Built by pagedserve/kernels/panel_cpu.py (pagedserve/kernels/native_build.py); plain C ABI.
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
typedef float V __attribute__((vector_size(64)));
constexpr int NV = 4;  // 24 sums, 4 weight vectors and x: 29 of the 32 vector registers
static inline V bcast(const float* p) { return _mm512_set1_ps(*p); }  // a load that broadcasts: 1-3%
#else
typedef float V __attribute__((vector_size(32)));
constexpr int NV = 2;  // 12 sums, 2 weight vectors and x: 15 of 16
static inline V bcast(const float* p) { return (V){} + *p; }  // (_mm256_broadcast_ss spilled the sums: 0.6x)
#endif
constexpr int VW = sizeof(V) / sizeof(float);
constexpr int P = NV * VW, HALF = P / 2;
constexpr int MR = 6;

extern "C" int64_t panel_width() { return P; }

// Where a panel's sums go: its first half to columns c0 (n0 of them), its second to c1 (n1);
// gated: y gets silu(first) * second at c0 instead (w a gate/up weight, y [M, H]).
struct Cols { int64_t c0, n0, c1, n1; bool gated; };

// R rows of x by one panel over kn steps of K; one cache line of pf (up to pf_end) asked for
// per step
template <int R>
static inline void tile(const float* x, int64_t sx, const float* w, int64_t kn, const float* b,
                        float* y, int64_t sy, const Cols& c, bool add, const char*& pf,
                        const char* pf_end) {
  V acc[R][NV] = {};
#pragma GCC unroll 4
  for (int64_t k = 0; k < kn; k++) {
    if (pf < pf_end) { __builtin_prefetch(pf, 0, 3); pf += 64; }
    V wv[NV];
    for (int v = 0; v < NV; v++) memcpy(&wv[v], w + k * P + v * VW, sizeof(V));
    for (int i = 0; i < R; i++) {
      const V a = bcast(x + i * sx + k);
      for (int v = 0; v < NV; v++) acc[i][v] += a * wv[v];
    }
  }
  for (int i = 0; i < R; i++) {
    float out[P];
    memcpy(out, acc[i], sizeof(out));
    float* row = y + i * sy;
    if (c.gated) { silu_mul_row(out, out + HALF, row + c.c0, c.n0); continue; }
    for (int64_t j = 0; j < c.n0; j++) row[c.c0 + j] = (add ? row[c.c0 + j] : 0.0f) + out[j] + (b ? b[c.c0 + j] : 0.0f);
    for (int64_t j = 0; j < c.n1; j++)
      row[c.c1 + j] = (add ? row[c.c1 + j] : 0.0f) + out[HALF + j] + (b ? b[c.c1 + j] : 0.0f);
  }
}

template <int R>
static inline void tiles_at(const float* x, int64_t sx, const float* w, int64_t kn, const float* b,
                            float* y, int64_t sy, const Cols& c, bool add, int64_t rows,
                            const char*& pf, const char* pf_end) {
  if constexpr (R > 0) {
    if (rows == R) return tile<R>(x, sx, w, kn, b, y, sy, c, add, pf, pf_end);
    tiles_at<R - 1>(x, sx, w, kn, b, y, sy, c, add, rows, pf, pf_end);
  }
}

static inline int64_t clamp(int64_t v) { return v < 0 ? 0 : v > HALF ? HALF : v; }

// gated: y [M, H] (row stride sy) = silu(gate) * up, N = 2H, K in one chunk
extern "C" void panel_f32(const float* x, int64_t sx, const float* wp, const float* b, float* y, int64_t sy,
                          int64_t M, int64_t N, int64_t K, int64_t max_k, int64_t threads, bool gated) {
  const int64_t H = (N + 1) / 2, panels = (H + HALF - 1) / HALF;
  const int64_t chunks = gated ? 1 : (K + max_k - 1) / max_k, kc = (K + chunks - 1) / chunks;
  // panels that do not split evenly over the threads (576 columns: 9 of 64) are cut in row
  // ranges too, else one thread waits for another's last panel
  int64_t parts = 1;
  if (threads > 1 && panels % threads && panels < 16 * threads) {
    int64_t g = panels, t = threads;
    while (t) { const int64_t r = g % t; g = t; t = r; }
    parts = threads / g;
  }
  int64_t rows = (M + parts - 1) / parts;
  rows = (rows + MR - 1) / MR * MR;
  parts = (M + rows - 1) / rows;
  split_blocks(panels * parts, threads, [&](int64_t unit, bool more) {
    const int64_t p = unit / parts, m0 = unit % parts * rows, m1 = m0 + rows < M ? m0 + rows : M;
    const Cols c{p * HALF, clamp(H - p * HALF), H + p * HALF, clamp(N - H - p * HALF), gated};
    const bool next_panel = more && m1 == M;  // this thread's next unit is the next panel
    for (int64_t k0 = 0; k0 < K; k0 += kc) {
      const int64_t kn = K - k0 < kc ? K - k0 : kc;
      const float* w = wp + (p * K + k0) * P;
      const char* pf = (const char*)(w + kn * P);  // the next chunk, or the next panel
      const char* pf_end = k0 + kn < K || next_panel ? pf + kn * P * sizeof(float) : pf;
      const float* bias = k0 == 0 ? b : nullptr;
      int64_t m = m0;
      for (; m + MR <= m1; m += MR) tile<MR>(x + m * sx + k0, sx, w, kn, bias, y + m * sy, sy, c, k0 > 0, pf, pf_end);
      tiles_at<MR - 1>(x + m * sx + k0, sx, w, kn, bias, y + m * sy, sy, c, k0 > 0, m1 - m, pf, pf_end);
    }
  });
}
"""
VERSION = hashlib.sha256(SOURCE.encode()).hexdigest()[:8]  # kept timings of another build are not used
MAX_K = 768  # K longer than this is cut in even chunks: a panel's chunk (64 x 768 floats, 192 KB)
# and the rows of x it meets stay in L2 (down's K of 1,536 in two)


@dataclass
class PanelWeight:
    """A weight [out_features, in_features] as pack() lays it out: data [panels, K, P]."""

    data: torch.Tensor
    out_features: int

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


def _build() -> ctypes.CDLL | None:
    lib = native_build.load("panel_cpu", SOURCE)
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.panel_width.argtypes, lib.panel_width.restype = [], i64
    lib.panel_f32.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, ctypes.c_bool]
    lib.panel_f32.restype = None
    return lib


_native = native_build.Library(_build)


def available() -> bool:
    """Whether the kernel is built and loaded (builds it on first call)."""
    return _native.get() is not None


def unavailable_for(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why this kernel cannot serve weights of `dtype` on `device`, or None."""
    return _native.float32_cpu("the C++ panel kernel", device, dtype)


def unavailable(weight: torch.Tensor) -> str | None:
    """Why this kernel cannot multiply by `weight`, or None."""
    if weight.dim() != 2:
        return f"the C++ panel kernel takes an [N, K] weight ({list(weight.shape)})"
    return unavailable_for(weight.device, weight.dtype)


def pack(weight: torch.Tensor) -> PanelWeight:
    """The panels of `weight` (raises ValueError where unavailable() says why): panel p holds the
    P/2 rows from p * P/2 and the P/2 from H + p * P/2 (H = ceil(N / 2); zero rows pad), so that
    a gate/up weight's panel holds a gate row and its up row side by side (matmul_silu)."""
    if (why := unavailable(weight)) is not None:
        raise ValueError(why)
    n, k = weight.shape
    half = _native.get().panel_width() // 2
    h = -(-n // 2)
    rows = -(-h // half) * half
    halves = torch.zeros(2, rows, k)
    halves[0, :h] = weight.detach()[:h]
    halves[1, :n - h] = weight.detach()[h:]
    panels = halves.view(2, -1, half, k).transpose(0, 1).reshape(-1, 2 * half, k)
    return PanelWeight(panels.transpose(1, 2).contiguous(), n)


def _call(x: torch.Tensor, packed: PanelWeight, bias: torch.Tensor | None, y: torch.Tensor, gated: bool) -> None:
    m, k = x.shape
    assert x.dtype == torch.float32 and x.stride(1) == 1 and packed.data.shape[1] == k
    if m:
        threads = max(1, min(torch.get_num_threads(), 2 * packed.data.shape[0]))
        _native.get().panel_f32(x.data_ptr(), x.stride(0), packed.data.data_ptr(),
                                None if bias is None else bias.data_ptr(), y.data_ptr(), y.stride(0), m,
                                packed.out_features, k, MAX_K, threads, gated)


def matmul(x: torch.Tensor, packed: PanelWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (unit stride along K) @ weight.T, + bias [N] if given, into a new [M, N] tensor."""
    n = packed.out_features
    assert bias is None or (bias.is_contiguous() and bias.shape == (n,))
    y = torch.empty(x.shape[0], n)
    _call(x, packed, bias, y, gated=False)
    return y


def matmul_silu(x: torch.Tensor, packed: PanelWeight) -> torch.Tensor:
    """silu(gate) * up into a new [M, N/2] tensor, where [gate | up] = x [M, K] (unit stride along
    K) @ weight.T and the weight (N even) holds the gate rows then the up rows: the gate/up
    projection with SiLU-and-multiply applied to each tile's sums, its [M, N] output never
    written (K in one chunk)."""
    assert packed.out_features % 2 == 0
    y = torch.empty(x.shape[0], packed.out_features // 2)
    _call(x, packed, None, y, gated=True)
    return y
