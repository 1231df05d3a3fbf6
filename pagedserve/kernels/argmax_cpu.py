"""Each row's most likely token in C++, for the CPU float32 path: greedy sampling's argmax.

greedy_ids(logits [rows, vocab]) -> int64 [rows]: the index of each row's largest value, the
first where several tie, the first NaN where a row has one: what `logits.max(-1).indices`
gives (the reference, and the path taken where this kernel does not apply: another device or
dtype, a row stride other than the vocab's, the library not built). torch's reduction takes
1.5 ms over the default model's 64 x 49,152 logits on two cores; this one reads them once,
eight lanes at a time, rows split over the OpenMP threads (BENCHMARKS.md, issue 44). Built by
pagedserve/kernels/native_build.py; tested in tests/unit/kernels/test_argmax_cpu.py.
"""
from __future__ import annotations

import ctypes

import torch

from pagedserve.kernels import native_build

SOURCE = r"""
// out[r] = the first index of the largest x[r][i] (of the first NaN, where the row has one).
// Built by pagedserve/kernels/argmax_cpu.py (pagedserve/kernels/native_build.py); plain C ABI.
#include <cmath>
#include <cstdint>
#include <cstring>

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t vi8 __attribute__((vector_size(32)));

static int64_t argmax_row(const float* x, int64_t n) {
    int64_t i = 0;
    int64_t best = 0;
    float top = -INFINITY;
    bool nan = false;
    if (n >= 8) {
        // per lane: the largest value seen and the first index it was seen at (a later equal
        // value does not replace it: strictly greater only)
        v8 m, any_nan = {};
        memcpy(&m, x, 32);
        vi8 at = {0, 1, 2, 3, 4, 5, 6, 7}, idx = at;
        const vi8 step = {8, 8, 8, 8, 8, 8, 8, 8};
        any_nan = m != m ? v8{} + 1 : any_nan;
        for (i = 8; i + 8 <= n; i += 8) {
            v8 v;
            memcpy(&v, x + i, 32);
            idx += step;
            const vi8 gt = v > m;
            m = gt ? v : m;
            at = gt ? idx : at;
            any_nan = v != v ? v8{} + 1 : any_nan;
        }
        for (int l = 0; l < 8; ++l) {
            nan |= any_nan[l] != 0;
            if (m[l] > top || (m[l] == top && at[l] < best)) top = m[l], best = at[l];
        }
    }
    for (; i < n; ++i) {
        nan |= x[i] != x[i];
        if (x[i] > top) top = x[i], best = i;
    }
    if (nan)  // torch takes the first NaN
        for (int64_t j = 0; j < n; ++j)
            if (x[j] != x[j]) return j;
    return best;
}

extern "C" void argmax_rows_f32(const float* x, int64_t sx, int64_t rows, int64_t n, int64_t* out,
                                int64_t threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t r = 0; r < rows; ++r) out[r] = argmax_row(x + r * sx, n);
}
"""


def _build() -> ctypes.CDLL | None:
    lib = native_build.load("argmax_cpu", SOURCE)
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.argmax_rows_f32.argtypes = [ptr, i64, i64, i64, ptr, i64]
    lib.argmax_rows_f32.restype = None
    return lib


_native = native_build.Library(_build)
ROWS_PER_THREAD = 8  # below this many rows a thread, one thread (waking the other costs more)


def available() -> bool:
    """Whether the kernel is built and loaded (builds it on first call)."""
    return _native.get() is not None


def applies(logits: torch.Tensor) -> bool:
    """Whether logits take the C++ argmax: 2-D float32 on the CPU, unit stride along the
    vocab, the library built."""
    return (logits.dim() == 2 and logits.dtype == torch.float32 and logits.device.type == "cpu"
            and logits.stride(1) == 1 and logits.shape[1] > 0 and available())


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """Each row's most likely token (int64 [rows]); the same indices as logits.max(-1).indices."""
    if not applies(logits):
        return logits.max(-1).indices
    rows, n = logits.shape
    out = torch.empty(rows, dtype=torch.int64)
    if rows:
        threads = max(1, min(torch.get_num_threads(), rows // ROWS_PER_THREAD))
        _native.get().argmax_rows_f32(logits.data_ptr(), logits.stride(0), rows, n, out.data_ptr(), threads)
    return out
