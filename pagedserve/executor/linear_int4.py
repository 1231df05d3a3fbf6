"""Int4 weights for a linear layer, read exactly from Q4_1 GGUF weights, and the matmul.

A Q4_1 GGUF stores each group of 32 weights along a row as w = d * q + m (d, m float16, q in
0..15); the GGUF converter writes those values dequantized into float32, exactly. pack(weight
[N, K], float32) reads them back: per group m = the group's minimum, d = float16((max - m) / 15),
q = round((w - m) / d), and it accepts the weight only if d * q + m reproduces every value
bit for bit with m a float16 (else NotQ4_1, naming the layer and the fix): no requantization,
the GGUF's own q, d and m. The kernel (torch.ops.aten._weight_int4pack_mm_for_cpu, group size
32) computes w = (q - 8) * scale + zero, so scale = d and zero = m + 8 d, both held in
bfloat16 (the kernel takes scales in its activations' dtype) - the one rounding beyond Q4_1's,
up to 2^-9 of d and of the zero per group.

matmul(x [M, K], w, bias) casts x to bfloat16 (the kernel's float32 path is scalar, ~30x
slower; float16's too), multiplies with float32 accumulation inside, rounds the result to
bfloat16, casts it back to x's dtype and adds the bias. Not exact: a model on it is measured
against float32 (BENCHMARKS.md, pagedserve/benchmarks/int8_accuracy.py) and it is never chosen unless
asked for (--linear-backend int4). Shapes: K a multiple of 32, N a multiple of 16.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP = 32
N_MULTIPLE = 16
ACTIVATIONS = torch.bfloat16
ALIGN = 64  # bytes
OPS = ("_weight_int4pack_mm_for_cpu", "_convert_weight_to_int4pack_for_cpu")  # torch.ops.aten


class NotQ4_1(ValueError):
    """The weight is not the exact float32 image of Q4_1 weights."""


@dataclass
class Int4Weight:
    packed: torch.Tensor       # uint8, the kernel's layout of q
    scale_zeros: torch.Tensor  # bfloat16 [K / GROUP, N, 2]: (scale, zero) per group and row

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scale_zeros.numel() * self.scale_zeros.element_size()


def unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why int4 weights cannot serve here, or None."""
    if device.type != "cpu":
        return f"int4 weights are offered on the CPU only (device {device}): drop --linear-backend int4"
    if dtype != torch.float32:
        return (f"int4 weights are read from the float32 image of the GGUF's Q4_1 weights "
                f"(dtype {dtype}): use --dtype float32")
    for op in OPS:
        if not hasattr(torch.ops.aten, op):
            return f"this torch build lacks torch.ops.aten.{op}: use --linear-backend auto"
    return None


def q4_1_parts(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q uint8 [N, K], d float32 [N, K/32], m float32 [N, K/32]) with d * q + m == weight
    exactly, d and m float16 values; raises NotQ4_1 otherwise."""
    n, k = weight.shape
    name = f"linear {n}x{k}"
    if weight.dtype != torch.float32:
        raise NotQ4_1(f"{name}: int4 reads Q4_1 from float32 weights, got {weight.dtype}: use --dtype float32")
    if k % GROUP or n % N_MULTIPLE:
        raise NotQ4_1(f"{name}: int4 needs in_features a multiple of {GROUP} and out_features a "
                      f"multiple of {N_MULTIPLE} (the kernel's groups and blocks)")
    w = weight.detach().view(n, k // GROUP, GROUP)
    m = w.amin(-1)
    d = ((w.amax(-1) - m) / 15).half().float()
    q = torch.round((w - m[..., None]) / torch.where(d == 0, 1.0, d)[..., None]).clamp_(0, 15)
    exact = (q * d[..., None] + m[..., None] == w).all(-1) & (m.half().float() == m)
    if not exact.all():
        bad = (~exact).nonzero()[0].tolist()
        raise NotQ4_1(f"{name}: not Q4_1 weights: {(~exact).sum().item()} of {exact.numel()} groups "
                      f"of {GROUP} (first: row {bad[0]}, columns {bad[1] * GROUP}-{bad[1] * GROUP + GROUP - 1}) "
                      f"are not d*q+m with float16 d, m and q in 0..15; --linear-backend int4 serves "
                      f"a Q4_1 GGUF's weights (others stay float32)")
    return q.to(torch.uint8).view(n, k), d, m


def pack(weight: torch.Tensor) -> Int4Weight:
    q, d, m = q4_1_parts(weight)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    scale_zeros = torch.stack([d, m + 8 * d], -1).transpose(0, 1).to(ACTIVATIONS).contiguous()
    return Int4Weight(packed, scale_zeros)


def dequantize(q: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    """The weight [N, K] the kernel multiplies by, in float64, given q (for tests)."""
    sz = w.scale_zeros.double().transpose(0, 1).repeat_interleave(GROUP, 1)  # [N, K, 2]
    return (q.double() - 8) * sz[..., 0] + sz[..., 1]


def matmul(x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None) -> torch.Tensor:
    a = x.to(ACTIVATIONS).contiguous()
    if a.data_ptr() % ALIGN:
        a = a.clone()
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(a, w.packed, GROUP, w.scale_zeros).to(x.dtype)
    return y if bias is None else y.add_(bias)
