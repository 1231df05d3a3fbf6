"""Rotary embedding applied in the K/V store, for the CPU float32 path.

rotary_store_kv_(qk, v, cos, sin, k_cache, v_cache, slot_mapping) -> q: one C++ pass over a
step's tokens rotates the Q heads of qk [T, q_heads + kv_heads, head_dim] in place and writes
the rotated K heads and v [T, kv_heads, head_dim] straight into their slots of the layer's
caches (pagedserve.kernels.store_kv's contract: negative slots skipped), where the torch path makes a
rotary pass over Q and K and then store_kv's two copies. qk's K heads are left unrotated (the
attention reads K from the cache). Returns the Q heads, a view of qk. The reference is
kernels/fused_ref.rotary_store_kv_ref.

The caller checks applies(qk, k_cache) first: float32 CPU tensors, caches [blocks,
block_size, kv_heads, head_dim] with unit stride along head_dim and the same strides (the
pool's views), and the library built (pagedserve/kernels/native_build.py; PAGEDSERVE_NATIVE_KERNELS=0 or
PAGEDSERVE_FUSED_OPS=0 turn it off, as for pagedserve/kernels/fused_cpu.py).
"""
from __future__ import annotations

import ctypes

import torch

from pagedserve.kernels import native_build
from pagedserve.kernels.fused_cpu import _threads, fused_ops_on

SOURCE = r"""
// Rotary embedding applied in the K/V store, float32, tokens split over OpenMP threads.
// Built by pagedserve/kernels/rotary_store_cpu.py (pagedserve/kernels/native_build.py); plain C ABI.
#include <cstdint>

extern "C" {

// qk [rows, q_heads + kv_heads, 2 * half] (strides sx, sh, 1): the Q heads rotated in place,
// the K heads rotated into kc; v [rows, kv_heads, 2 * half] (strides svx, svh, 1) copied into
// vc. Token t goes to slot slots[t]: block slots[t] / bs, offset slots[t] % bs (cache strides
// cb, ct, ch, 1); negative slots are skipped. Returns how many slots were past `capacity`
// (not written).
int64_t rotary_store_f32(float* qk, int64_t sx, int64_t sh, const float* v, int64_t svx,
                         int64_t svh, const float* cos, const float* sin, int64_t sc, float* kc,
                         float* vc, int64_t cb, int64_t ct, int64_t ch, const int64_t* slots,
                         int64_t bs, int64_t capacity, int64_t rows, int64_t q_heads,
                         int64_t kv_heads, int64_t half, int64_t threads) {
    int64_t bad = 0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(+ : bad) if (threads > 1)
    for (int64_t t = 0; t < rows; ++t) {
        const float* c = cos + t * sc;
        const float* s = sin + t * sc;
        for (int64_t h = 0; h < q_heads; ++h) {
            float* a = qk + t * sx + h * sh;
            float* b = a + half;
#pragma omp simd
            for (int64_t i = 0; i < half; ++i) {
                const float x1 = a[i], x2 = b[i];
                a[i] = x1 * c[i] - x2 * s[i];
                b[i] = x2 * c[i] + x1 * s[i];
            }
        }
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        if (slot >= capacity) {
            ++bad;
            continue;
        }
        const int64_t at = (slot / bs) * cb + (slot % bs) * ct;
        for (int64_t h = 0; h < kv_heads; ++h) {
            const float* a = qk + t * sx + (q_heads + h) * sh;
            const float* b = a + half;
            float* ka = kc + at + h * ch;
            float* kb = ka + half;
#pragma omp simd
            for (int64_t i = 0; i < half; ++i) {
                ka[i] = a[i] * c[i] - b[i] * s[i];
                kb[i] = b[i] * c[i] + a[i] * s[i];
            }
            const float* from = v + t * svx + h * svh;
            float* to = vc + at + h * ch;
#pragma omp simd
            for (int64_t i = 0; i < 2 * half; ++i) to[i] = from[i];
        }
    }
    return bad;
}

}  // extern "C"
"""


def _build() -> ctypes.CDLL | None:
    if not fused_ops_on():
        return None
    lib = native_build.load("rotary_store_cpu", SOURCE)
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.rotary_store_f32.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64, ptr, ptr, i64, i64, i64,
                                     ptr, i64, i64, i64, i64, i64, i64, i64]
    lib.rotary_store_f32.restype = i64
    return lib


_native = native_build.Library(_build)


def available() -> bool:
    """Whether the kernel is built and loaded (builds it on first call)."""
    return _native.get() is not None


def applies(qk: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether rotary_store_kv_ takes these: float32 CPU tensors, the pool's cache views, the
    library built."""
    return (qk.dtype == k_cache.dtype == v_cache.dtype == torch.float32 and qk.device.type == "cpu"
            and k_cache.device.type == "cpu" and k_cache.dim() == 4 and k_cache.stride(3) == 1
            and k_cache.stride() == v_cache.stride() and available())


def rotary_store_kv_(qk, v, cos, sin, k_cache, v_cache, slot_mapping) -> torch.Tensor:
    """See the module docstring; cos/sin [T, head_dim/2] or [T, 1, head_dim/2] (unit stride
    along the last); slot_mapping int64 [T]. ValueError when a slot is past the caches."""
    rows, heads, dim = qk.shape
    blocks, block_size, kv_heads = k_cache.shape[:3]
    q_heads = heads - kv_heads
    assert qk.stride(2) == 1 and v.stride(2) == 1 and tuple(v.shape) == (rows, kv_heads, dim)
    assert cos.shape[0] == rows and cos.shape[-1] * 2 == dim and cos.stride(-1) == 1
    assert cos.shape == sin.shape and cos.stride() == sin.stride() and k_cache.shape[3] == dim
    slots = slot_mapping if slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous() \
        else slot_mapping.to(torch.int64).contiguous()
    assert slots.numel() == rows
    bad = _native.get().rotary_store_f32(
        qk.data_ptr(), qk.stride(0), qk.stride(1), v.data_ptr(), v.stride(0), v.stride(1),
        cos.data_ptr(), sin.data_ptr(), cos.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), slots.data_ptr(), block_size,
        blocks * block_size, rows, q_heads, kv_heads, dim // 2, _threads(qk.numel()))
    if bad:
        raise ValueError(f"slot_mapping: {bad} slots past the cache's {blocks * block_size}: "
                         "slots must lie within the pool")
    return qk[:, :q_heads]
