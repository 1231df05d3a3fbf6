"""Rotary position embeddings: the inverse frequencies, with the scalings of
pagedserve/executor/rope_scaling.py, and their application to q and k."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagedserve.executor.model_config import ModelConfig


def rotary_inv_freq(config: ModelConfig, theta: float | None = None, rs=None) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] in float32, with llama3, linear or longrope scaling
    when configured (theta and rs default to the config's global ones)."""
    d = config.head_dim
    theta = config.rope_theta if theta is None else theta
    rs = config.rope_scaling if rs is None else rs
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if rs.rope_type == "linear":
        return inv_freq / rs.factor
    if rs.rope_type == "longrope":  # Phi-3: the short factors (contexts up to the original length)
        return 1.0 / (torch.tensor(rs.short_factor, dtype=torch.float32)
                      * theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if rs.rope_type != "llama3":
        return inv_freq
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between
    # the two thresholds interpolated smoothly.
    old_len = rs.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / rs.low_freq_factor, inv_freq / rs.factor, inv_freq)
    smooth = (old_len / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
    blended = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = (wavelen >= old_len / rs.high_freq_factor) & (wavelen <= old_len / rs.low_freq_factor)
    return torch.where(medium, blended, scaled)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] in the half-split layout; cos/sin [T, 1, head_dim/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
