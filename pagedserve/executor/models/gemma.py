"""Gemma 2 and Gemma 3 (text) over the paged KV pool: what differs from the Llama decoder.

- RMSNorm scales by (1 + weight), computed in float32 and cast back after the scale;
- four norms a layer: input, post-attention (on the attention output, before the residual),
  pre- and post-feedforward (around the MLP);
- embeddings scaled by sqrt(hidden_size) (in the model's dtype), gelu-tanh MLP;
- attention scale query_pre_attn_scalar ** -0.5; sliding and global layers alternate
  (config.layer_types), each sliding layer attends to its window only;
- Gemma 2: attention scores and final logits soft-capped (cap * tanh(x / cap));
- Gemma 3: q/k RMSNorm (the Gemma kind) and a separate rotary base for sliding layers.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedserve.executor.models.llama import DecoderLayer, LlamaForCausalLM
from pagedserve.kernels import fused


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight is (1 + w) in float32 (GemmaDecoderLayer.norm_weight)."""
    if fused.applies(x) and x.is_contiguous():  # the same arithmetic in Triton (CUDA) or C++ (CPU float32)
        return fused.rms_norm(x, weight, eps, round_first=False)
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


class GemmaDecoderLayer(DecoderLayer):
    norm = staticmethod(gemma_rms_norm)

    @staticmethod
    def norm_weight(weight: torch.Tensor) -> torch.Tensor:
        return 1.0 + weight.float()

    def init_mlp(self, w, prefix: str) -> None:
        super().init_mlp(w, prefix)
        p = lambda t: nn.Parameter(t, requires_grad=False)  # noqa: E731
        self.pre_ff_norm = p(self.norm_weight(w[prefix + "pre_feedforward_layernorm.weight"]))
        self.post_ff_norm = p(self.norm_weight(w[prefix + "post_feedforward_layernorm.weight"]))

    def forward(self, x, cos, sin, k_cache, v_cache, meta):
        eps = self.config.rms_norm_eps
        h = self.attention(self.norm(x, self.input_norm, eps), cos, sin, k_cache, v_cache, meta)
        x = x + self.norm(h, self.post_attn_norm, eps)
        h = self.norm(self.mlp(self.norm(x, self.pre_ff_norm, eps)), self.post_ff_norm, eps)
        return x.add_(h)


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma2ForCausalLM and Gemma3ForCausalLM (the config tells them apart)."""

    layer_class = GemmaDecoderLayer
    final_norm = staticmethod(gemma_rms_norm)

    def embed_tokens(self, input_ids):
        x = super().embed_tokens(input_ids)
        return x * torch.tensor(self.config.hidden_size ** 0.5, dtype=x.dtype)
