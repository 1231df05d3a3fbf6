"""The fused per-layer ops of the decoder, one call whatever the device: CUDA tensors (float32,
bfloat16, float16) go to the Triton kernels (pagedserve/kernels/fused_triton.py,
rotary_store_triton.py), CPU float32 tensors to the C++ ones (fused_cpu.py,
rotary_store_cpu.py, as before). The models check the op's `*applies` first and otherwise keep
their torch code, the reference the twins are tested against (fused_ref.py).

- applies(x) / rms_norm(x, w, eps, round_first) / add_rms_norm_(x, residual, w, eps);
- silu_applies(gate_up) / silu_and_mul(gate_up) (on the CPU written over gate_up's gate half);
- rotary_store_applies(qk, k_cache, v_cache) / rotary_store_kv_(qk, v, cos, sin, k_cache,
  v_cache, slot_mapping) -> the rotated Q heads (the K heads and v written into the caches).

round_first says where a 16-bit norm rounds (fused_triton.py); the CPU's float32 ignores it.
PAGEDSERVE_FUSED_OPS=0 turns both devices' fused ops off (on CUDA, read at first import).
"""
from __future__ import annotations

import importlib.util

import torch

from pagedserve.kernels import fused_cpu, rotary_store_cpu

_TRITON = importlib.util.find_spec("triton") is not None and fused_cpu.fused_ops_on()
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _triton_on(*tensors: torch.Tensor) -> bool:
    return _TRITON and all(t.is_cuda for t in tensors)


def _triton(name: str):
    from pagedserve.kernels import fused_triton, rotary_store_triton

    return {"fused": fused_triton, "rotary_store": rotary_store_triton}[name]


def applies(x: torch.Tensor) -> bool:
    """Whether x takes rms_norm / add_rms_norm_ (rms_norm also needs x contiguous)."""
    if _triton_on(x):
        return x.dtype in _DTYPES
    return fused_cpu.applies(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, round_first: bool = True) -> torch.Tensor:
    if _triton_on(x):
        return _triton("fused").rms_norm(x, weight, eps, round_first)
    return fused_cpu.rms_norm(x, weight, eps)


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if _triton_on(x):
        return _triton("fused").add_rms_norm_(x, residual, weight, eps)
    return fused_cpu.add_rms_norm_(x, residual, weight, eps)


def silu_applies(gate_up: torch.Tensor) -> bool:
    """CUDA: any [T, 2n] with unit stride along it (one launch for two at any T); the CPU:
    fused_cpu.silu_applies (from SILU_MIN_ROWS rows)."""
    if _triton_on(gate_up):
        return gate_up.dtype in _DTYPES and gate_up.dim() == 2 and gate_up.stride(1) == 1
    return fused_cpu.silu_applies(gate_up)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up [T, n]; gate_up is the caller's scratch (the CPU's kernel writes over it)."""
    if _triton_on(gate_up):
        return _triton("fused").silu_and_mul(gate_up)
    return fused_cpu.silu_and_mul_(gate_up)


def rotary_store_applies(qk: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    if _triton_on(qk, k_cache, v_cache):
        return (qk.dtype in _DTYPES and k_cache.dim() == 4 and qk.stride(2) == 1
                and k_cache.stride(3) == v_cache.stride(3) == 1)
    return rotary_store_cpu.applies(qk, k_cache, v_cache)


def rotary_store_kv_(qk, v, cos, sin, k_cache, v_cache, slot_mapping) -> torch.Tensor:
    if _triton_on(qk, k_cache, v_cache):
        return _triton("rotary_store").rotary_store_kv_(qk, v, cos, sin, k_cache, v_cache, slot_mapping)
    return rotary_store_cpu.rotary_store_kv_(qk, v, cos, sin, k_cache, v_cache, slot_mapping)
