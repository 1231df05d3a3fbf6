"""The decoder of Llama, Mistral, Qwen2 and Qwen3, over the paged KV pool.

All tokens of a step are packed in one dimension T. Each layer does one fused QKV
projection and one fused gate/up projection; per-sequence attention is the kernels'
business (`kernels.paged_attention` walks each sequence's block table).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from executor.attention_metadata import AttentionMetadata
from executor.model_config import ModelConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, like the reference implementation, then cast back."""
    if x.dtype != torch.float32:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(x.dtype)
    # float32: the same arithmetic, in place on the temporaries (fewer ops and allocations)
    scale = x.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
    return (x * scale).mul_(weight)


def rotary_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] in float32, with llama3 scaling when configured."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    rs = config.rope_scaling
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


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, w: dict[str, torch.Tensor], prefix: str):
        super().__init__()
        self.config = config
        a, m = prefix + "self_attn.", prefix + "mlp."
        p = lambda t: nn.Parameter(t, requires_grad=False)  # noqa: E731
        self.input_norm = p(w[prefix + "input_layernorm.weight"])
        self.post_attn_norm = p(w[prefix + "post_attention_layernorm.weight"])
        self.qkv = p(torch.cat([w[a + "q_proj.weight"], w[a + "k_proj.weight"], w[a + "v_proj.weight"]]))
        self.qkv_bias = None
        if config.qkv_bias:
            self.qkv_bias = p(torch.cat([w[a + "q_proj.bias"], w[a + "k_proj.bias"], w[a + "v_proj.bias"]]))
        self.o = p(w[a + "o_proj.weight"])
        self.o_bias = p(w[a + "o_proj.bias"]) if config.o_bias else None
        self.q_norm = p(w[a + "q_norm.weight"]) if config.qk_norm else None
        self.k_norm = p(w[a + "k_norm.weight"]) if config.qk_norm else None
        self.gate_up = p(torch.cat([w[m + "gate_proj.weight"], w[m + "up_proj.weight"]]))
        self.down = p(w[m + "down_proj.weight"])

    def forward(self, x, cos, sin, k_cache, v_cache, meta: AttentionMetadata):
        c = self.config
        t = x.shape[0]
        h = rms_norm(x, self.input_norm, c.rms_norm_eps)
        qkv = F.linear(h, self.qkv, self.qkv_bias)
        heads = c.num_heads + c.num_kv_heads
        if self.q_norm is not None:
            q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], -1)
            q = rms_norm(q.view(t, c.num_heads, c.head_dim), self.q_norm, c.rms_norm_eps)
            k = rms_norm(k.view(t, c.num_kv_heads, c.head_dim), self.k_norm, c.rms_norm_eps)
            qk = torch.cat((q, k), 1)
        else:  # q and k side by side in one view: one rotary pass over both
            qk = qkv[:, : c.q_size + c.kv_size].view(t, heads, c.head_dim)
        qk = apply_rotary(qk, cos, sin)
        q, k = qk.split([c.num_heads, c.num_kv_heads], 1)
        v = qkv[:, c.q_size + c.kv_size:].view(t, c.num_kv_heads, c.head_dim)
        kernels.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        o = kernels.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                    meta.query_start_loc, c.head_dim ** -0.5)
        x = x + F.linear(o.reshape(t, c.q_size), self.o, self.o_bias)  # x is the caller's: not in place
        h = rms_norm(x, self.post_attn_norm, c.rms_norm_eps)
        gate, up = F.linear(h, self.gate_up).chunk(2, dim=-1)
        return x.add_(F.linear(F.silu(gate).mul_(up), self.down))


class LlamaForCausalLM(nn.Module):
    """forward(input_ids [T], positions [T], meta, kv_pool) -> final hidden states [T, H];
    compute_logits(hidden [N, H]) -> float32 logits [N, vocab]."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor]):
        super().__init__()
        self.config = config
        self.embed = nn.Parameter(weights["model.embed_tokens.weight"], requires_grad=False)
        self.layers = nn.ModuleList(
            DecoderLayer(config, weights, f"model.layers.{n}.") for n in range(config.num_layers)
        )
        self.norm = nn.Parameter(weights["model.norm.weight"], requires_grad=False)
        head = self.embed if config.tie_word_embeddings else weights["lm_head.weight"]
        self.lm_head = head if config.tie_word_embeddings else nn.Parameter(head, requires_grad=False)
        self.register_buffer("inv_freq", rotary_inv_freq(config), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_pool: torch.Tensor):
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        cos = freqs.cos().to(self.dtype)[:, None, :]
        sin = freqs.sin().to(self.dtype)[:, None, :]
        x = F.embedding(input_ids, self.embed)
        for n, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv_pool[:, n, 0], kv_pool[:, n, 1], meta)
        return rms_norm(x, self.norm, self.config.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head).float()
