"""Int8 weights for a linear layer: symmetric per-output-channel quantization and the matmul.

quantize(weight [N, K]) -> Int8Weight: scales s = max|w_row| / 127 rounded to bfloat16 (the
kernel's scale dtype), q = round(w / s) clamped to [-127, 127] in int8 [N, K] (a zero row
gets q = 0). matmul(x [M, K], w, bias) multiplies through torch._weight_int8pack_mm with
bfloat16 activations: x cast in, float32 accumulation inside, the result rounded to bfloat16
and cast back to x's dtype, then the bias added. On the CPU that kernel is vectorized for
bfloat16 only (float32 activations take its scalar loop, ~20x slower), reads 16 (AVX-512) or
8 (AVX2) values of K at a time with aligned loads and has no remainder loop: `unsupported`
refuses K not a multiple of 16. Not exact (weights rounded to 8 bits, activations and
outputs to bfloat16): a model on it is measured against float32 (BENCHMARKS.md) and it is
never chosen unless asked for.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

ACTIVATIONS = torch.bfloat16
K_MULTIPLE = 16
ALIGN = 64  # bytes; the kernel's aligned loads need at least 32


@dataclass
class Int8Weight:
    q: torch.Tensor       # int8 [N, K]
    scales: torch.Tensor  # bfloat16 [N]

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scales.numel() * self.scales.element_size()


def unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why int8 weights cannot serve here, or None (a shape the kernel cannot take is refused
    layer by layer: unsupported)."""
    if device.type != "cpu":
        return f"int8 weights are offered on the CPU only (device {device})"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"int8 weights serve float32 and bfloat16 models (dtype {dtype})"
    if not hasattr(torch, "_weight_int8pack_mm"):
        return "this torch build lacks torch._weight_int8pack_mm"
    return None


def unsupported(weight: torch.Tensor) -> str | None:
    """Why `weight` cannot be served by the int8 kernel here, or None."""
    if not hasattr(torch, "_weight_int8pack_mm"):
        return "this torch build lacks torch._weight_int8pack_mm"
    if weight.dim() != 2 or weight.shape[1] % K_MULTIPLE:
        return (f"int8 weights need in_features a multiple of {K_MULTIPLE} (the kernel has no "
                f"remainder loop), got shape {list(weight.shape)}")
    return None


def quantize(weight: torch.Tensor) -> Int8Weight:
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127).to(ACTIVATIONS)
    s = scales.float().clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(w / s[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
    return Int8Weight(q, scales)


def matmul(x: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    a = x.to(ACTIVATIONS).contiguous()
    if a.data_ptr() % ALIGN:  # a bfloat16 view at an offset: the kernel loads aligned
        a = a.clone()
    y = torch._weight_int8pack_mm(a, w.q, w.scales).to(x.dtype)
    return y if bias is None else y.add_(bias)
