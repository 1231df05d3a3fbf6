"""The small per-layer ops of the decoder as Triton kernels, for CUDA tensors in float32,
bfloat16 or float16 (the CPU's counterparts: pagedserve/kernels/fused_cpu.py; the references:
pagedserve/kernels/fused_ref.py):

- rms_norm(x, w, eps, round_first=True): rmsnorm(x) * w over the last dimension, one program
  per row, the sum of squares in float32;
- add_rms_norm_(x, residual, w, eps): x += residual in place (the sum rounded to x's dtype),
  then rms_norm of that sum;
- silu_and_mul(gate_up): silu(gate) * up, gate and up the halves of each row.

Each rounds where the torch code it replaces (pagedserve/executor/models/llama.py) rounds, so a
16-bit model computes what it computed before, up to float32 summation order: the norm is
scaled in float32 and, with round_first (Llama: `weight * x.to(dtype)`), rounded to x's dtype
before the weight, else (Gemma: `(x * weight).to(dtype)`) after it; silu(gate) is rounded
before the product. Outputs are new tensors in x's dtype. No host sync: graph-capturable.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.pool_share.device import on_device


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, stride_x, stride_r, stride_out, n, eps,
                     ADD: tl.constexpr, ROUND_FIRST: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if ADD:
        r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        summed = (x + r).to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + row * stride_x + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    scale = tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if ROUND_FIRST:
        y = (x * scale).to(out_ptr.dtype.element_ty).to(tl.float32) * w
    else:
        y = x * scale * w
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_kernel(gu_ptr, out_ptr, stride_gu, stride_out, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * stride_gu + n + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def _norm_warps(block: int) -> int:
    return min(16, max(1, block // 512))


def _norm(x, residual, weight, eps, round_first):
    rows, n = x.shape
    assert x.stride(1) == 1 and weight.shape == (n,) and weight.is_contiguous(), \
        "x: [T, n] with unit stride along n; weight: contiguous [n]"
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block = triton.next_power_of_2(n)
    r, stride_r = (residual, residual.stride(0)) if residual is not None else (x, 0)
    with on_device(x.device):
        _rms_norm_kernel[(rows,)](x, r, weight, out, x.stride(0), stride_r, out.stride(0), n, eps,
                                  ADD=residual is not None, ROUND_FIRST=round_first, BLOCK=block,
                                  num_warps=_norm_warps(block))
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, round_first: bool = True) -> torch.Tensor:
    """rmsnorm(x) * weight over the last dimension of a contiguous x (any leading shape)."""
    assert x.is_contiguous(), "x: contiguous"
    n = x.shape[-1]
    return _norm(x.view(-1, n), None, weight, eps, round_first).view(x.shape)


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x += residual in place (both [T, n], unit stride along n), then rmsnorm(x) * weight."""
    assert residual.shape == x.shape and residual.stride(1) == 1, "residual: x's shape, unit stride along n"
    return _norm(x, residual, weight, eps, True)


def silu_and_mul(gate_up: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """silu(gate) * up into a new [T, n] tensor, gate and up the halves of each row of
    gate_up [T, 2n] (unit stride along it)."""
    assert gate_up.dim() == 2 and gate_up.stride(1) == 1 and gate_up.shape[1] % 2 == 0, \
        "gate_up: [T, 2n] with unit stride along 2n"
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, n), dtype=gate_up.dtype, device=gate_up.device)
    if rows == 0:
        return out
    block = min(block, triton.next_power_of_2(n))
    with on_device(gate_up.device):
        _silu_and_mul_kernel[(rows, triton.cdiv(n, block))](gate_up, out, gate_up.stride(0), out.stride(0), n,
                                                             BLOCK=block, num_warps=4)
    return out
