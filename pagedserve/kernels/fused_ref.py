"""The torch references of the fused element-wise ops of a decoder layer: what the C++ kernels
(pagedserve/kernels/fused_cpu.py, pagedserve/kernels/rotary_store_cpu.py) compute, and what they and any other
twin are tested against (float32; the model's own torch path: pagedserve/executor/models/decoder.py).

- rms_norm_ref(x, w, eps): x * rsqrt(mean(x^2) + eps) * w over the last dimension;
- add_rms_norm_ref(x, residual, w, eps) -> (x + residual, its rms_norm_ref);
- rotary_ref(x, cos, sin): the half-split rotary embedding of x [T, heads, head_dim];
- silu_and_mul_ref(gate_up): silu(gate) * up, gate and up the halves of gate_up's last dim;
- rotary_store_kv_ref(qk, v, cos, sin, k_cache, v_cache, slot_mapping, q_heads): qk [T,
  q_heads + kv_heads, head_dim] rotated; its K heads and v written into the slots
  (pagedserve.kernels.store_kv's contract); returns the rotated Q heads.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.kernels.store_kv_ref import store_kv_ref


def rms_norm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def add_rms_norm_ref(x, residual, w, eps) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual
    return summed, rms_norm_ref(summed, w, eps)


def rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """cos/sin [T, 1, head_dim/2] (or [T, head_dim/2])."""
    if cos.dim() == 2:
        cos, sin = cos[:, None], sin[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary_store_kv_ref(qk, v, cos, sin, k_cache, v_cache, slot_mapping, q_heads: int) -> torch.Tensor:
    rotated = rotary_ref(qk, cos, sin)
    store_kv_ref(rotated[:, q_heads:], v, k_cache, v_cache, slot_mapping)
    return rotated[:, :q_heads]
