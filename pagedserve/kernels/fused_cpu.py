"""The small per-layer ops of the decoder fused in C++, for the CPU float32 path.

In a decode step each of these is a handful of torch ops over a few kilobytes, and their
dispatch costs more than their arithmetic; one pass in C++ each (OpenMP over rows on the
runtime torch already loaded, GIL released by ctypes) replaces them:

- add_rms_norm_(x, residual, w): x += residual in place, returns rmsnorm(x) * w;
- rms_norm(x, w): rmsnorm(x) * w;
- rotary_(x, cos, sin): the half-split rotary embedding of x [T, heads, head_dim], in place;
- silu_and_mul_(gate_up): silu(gate) * up from the gate/up projection's output in one pass,
  written over the gate half (pagedserve/kernels/silu_row_cpu.py); the model takes it from
  SILU_MIN_ROWS rows (silu_applies), where the projection did not apply it itself.

Each is tested against the torch code it stands in for (tests/unit/kernels/test_fused_cpu.py,
test_fused_twins.py: the references in pagedserve/kernels/fused_ref.py); the rotary applied in the K/V
store is pagedserve/kernels/rotary_store_cpu.py.
The caller checks applies(x) first: a CPU float32 tensor and the library built
(pagedserve/kernels/native_build.py; PAGEDSERVE_NATIVE_KERNELS=0 or PAGEDSERVE_FUSED_OPS=0 turn it off,
the second leaving the attention kernel on). Otherwise it keeps its torch code.
"""
from __future__ import annotations

import ctypes
import os

import torch

from pagedserve.kernels import native_build, silu_row_cpu

SOURCE = r"""
// The small per-layer ops of the decoder, float32, rows split over OpenMP threads.
// Built by pagedserve/kernels/fused_cpu.py (pagedserve/kernels/native_build.py); plain C ABI, no torch headers.
#include <cmath>
#include <cstdint>
#include <cstring>

extern "C" {

// out[t] = x[t] * rsqrt(mean(x[t]^2) + eps) * w; with add, x[t] += r[t] first (in place).
void rms_norm_f32(float* x, int64_t sx, const float* r, int64_t sr, const float* w, float* out,
                  int64_t so, int64_t rows, int64_t n, float eps, int64_t add, int64_t threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t t = 0; t < rows; ++t) {
        float* xt = x + t * sx;
        float ss = 0.f;
        if (add) {
            const float* rt = r + t * sr;
#pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < n; ++i) {
                xt[i] += rt[i];
                ss += xt[i] * xt[i];
            }
        } else {
#pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < n; ++i) ss += xt[i] * xt[i];
        }
        const float scale = 1.f / std::sqrt(ss / n + eps);
        float* ot = out + t * so;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) ot[i] = xt[i] * scale * w[i];
    }
}

// x [rows, heads, 2 * half] (strides sx, sh, 1), in place; cos/sin [rows, half] (stride sc).
void rotary_f32(float* x, int64_t sx, int64_t sh, const float* cos, const float* sin, int64_t sc,
                int64_t rows, int64_t heads, int64_t half, int64_t threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t t = 0; t < rows; ++t) {
        const float* c = cos + t * sc;
        const float* s = sin + t * sc;
        for (int64_t h = 0; h < heads; ++h) {
            float* a = x + t * sx + h * sh;
            float* b = a + half;
#pragma omp simd
            for (int64_t i = 0; i < half; ++i) {
                const float x1 = a[i], x2 = b[i];
                a[i] = x1 * c[i] - x2 * s[i];
                b[i] = x2 * c[i] + x1 * s[i];
            }
        }
    }
}

}  // extern "C"

""" + silu_row_cpu.SOURCE + r"""
extern "C" {

// out[t, i] = silu(gu[t, i]) * gu[t, n + i]: gate and up side by side in each row of gu; out may
// be gu itself (each 8 lanes are read before they are written).
void silu_and_mul_f32(const float* gu, int64_t sg, float* out, int64_t so, int64_t rows, int64_t n,
                      int64_t threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t t = 0; t < rows; ++t) silu_mul_row(gu + t * sg, gu + t * sg + n, out + t * so, n);
}

}  // extern "C"
"""

def fused_ops_on() -> bool:
    """PAGEDSERVE_FUSED_OPS=0 turns the fused ops off, these and their Triton twins
    (pagedserve/kernels/fused.py), leaving the attention kernels on."""
    return os.environ.get("PAGEDSERVE_FUSED_OPS", "1") != "0"


def _build() -> ctypes.CDLL | None:
    if not fused_ops_on():
        return None
    lib = native_build.load("fused_cpu", SOURCE)
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.rms_norm_f32.argtypes = [ptr, i64, ptr, i64, ptr, ptr, i64, i64, i64, ctypes.c_float, i64, i64]
    lib.rotary_f32.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, i64, i64, i64]
    lib.silu_and_mul_f32.argtypes = [ptr, i64, ptr, i64, i64, i64, i64]
    for f in (lib.rms_norm_f32, lib.rotary_f32, lib.silu_and_mul_f32):
        f.restype = None
    return lib


_native = native_build.Library(_build)
SILU_MIN_ROWS = 32  # below, torch's two ops win (the call costs more than it saves): measured
# 0.54x at 1 row, 1.09x at 16, 1.35-1.41x at 64-512 (BENCHMARKS.md, issue 44)


def available() -> bool:
    """Whether the fused kernels are built and loaded (builds them on first call)."""
    return _native.get() is not None


def applies(x: torch.Tensor) -> bool:
    """Whether x takes the fused kernels: float32 on the CPU, with the library built."""
    return x.dtype == torch.float32 and x.device.type == "cpu" and available()


def _threads(elements: int) -> int:
    return max(1, min(torch.get_num_threads(), elements // 16384))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rmsnorm(x) * weight over the last dimension of a contiguous x, into a new tensor
    (weight: float32 [n], contiguous, as are the models' norm weights)."""
    assert x.is_contiguous()
    n = x.shape[-1]
    out = torch.empty_like(x)
    _native.get().rms_norm_f32(x.data_ptr(), n, None, 0, weight.data_ptr(), out.data_ptr(), n,
                               x.numel() // n, n, eps, 0, _threads(x.numel()))
    return out


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x += residual in place (both [T, n], unit stride along n), then rmsnorm(x) * weight."""
    assert x.stride(1) == 1 and residual.stride(1) == 1 and residual.shape == x.shape
    rows, n = x.shape
    out = torch.empty(rows, n)
    _native.get().rms_norm_f32(x.data_ptr(), x.stride(0), residual.data_ptr(), residual.stride(0),
                               weight.data_ptr(), out.data_ptr(), n, rows, n, eps, 1, _threads(x.numel()))
    return out


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] (unit stride along head_dim) rotated in place, half-split layout;
    cos/sin [T, head_dim/2] or [T, 1, head_dim/2], the same strides. Returns x."""
    rows, heads, dim = x.shape
    assert x.stride(2) == 1 and cos.shape[0] == rows and cos.shape[-1] * 2 == dim
    assert cos.shape == sin.shape and cos.stride() == sin.stride() and cos.stride(-1) == 1
    _native.get().rotary_f32(x.data_ptr(), x.stride(0), x.stride(1), cos.data_ptr(), sin.data_ptr(),
                             cos.stride(0), rows, heads, dim // 2, _threads(x.numel()))
    return x


def silu_applies(gate_up: torch.Tensor) -> bool:
    """Whether gate_up takes silu_and_mul_: applies(), [T, 2n] with unit stride along it, and
    T >= SILU_MIN_ROWS."""
    return (gate_up.dim() == 2 and gate_up.shape[0] >= SILU_MIN_ROWS and gate_up.stride(1) == 1
            and applies(gate_up))


def silu_and_mul_(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, gate and up the halves of each row of gate_up [T, 2n] (unit stride
    along it), written over the gate half: returns gate_up[:, :n] (row stride gate_up's). In
    place because a new tensor costs a prefill chunk's 12 MB more of memory traffic (the
    lines read in again before they are written): 2.4 -> 1.2 ms a call at 2,048 rows."""
    assert gate_up.dim() == 2 and gate_up.stride(1) == 1 and gate_up.shape[1] % 2 == 0
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    _native.get().silu_and_mul_f32(gate_up.data_ptr(), gate_up.stride(0), gate_up.data_ptr(), gate_up.stride(0),
                                   rows, n, _threads(rows * n))
    return gate_up[:, :n]
