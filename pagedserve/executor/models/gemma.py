"""Gemma 2 and Gemma 3 (text) over the paged KV pool: what differs from the Llama decoder.

- RMSNorm scales by (1 + weight), computed in float32 and cast back after the scale;
- four norms a layer: input, post-attention (on the attention output, before the residual),
  pre- and post-feedforward (around the MLP);
- embeddings scaled by sqrt(hidden_size) (in the model's dtype), gelu-tanh MLP;
- attention scale query_pre_attn_scalar ** -0.5; sliding and global layers alternate
  (config.layer_types), each sliding layer attends to its window only;
- Gemma 2: attention scores and final logits soft-capped (cap * tanh(x / cap));
- Gemma 3: q/k RMSNorm (the Gemma kind) and a separate rotary base for sliding layers.
Two families (family.py): GEMMA2 and GEMMA3, one decoder.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedserve.executor.models import config_fields
from pagedserve.executor.models.decoder import REFUSED, SHARDING, DecoderForCausalLM, DecoderLayer
from pagedserve.executor.models.family import Family
from pagedserve.executor.rope_scaling import read_rope_scaling
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

    @staticmethod
    def mlp_shapes(c, prefix: str) -> dict[str, tuple[int, ...]]:
        return {prefix + "pre_feedforward_layernorm.weight": (c.hidden_size,),
                prefix + "post_feedforward_layernorm.weight": (c.hidden_size,),
                **DecoderLayer.mlp_shapes(c, prefix)}

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


class GemmaForCausalLM(DecoderForCausalLM):
    """Gemma2ForCausalLM and Gemma3ForCausalLM (the config tells them apart)."""

    layer_class = GemmaDecoderLayer
    final_norm = staticmethod(gemma_rms_norm)

    def embed_tokens(self, input_ids):
        x = super().embed_tokens(input_ids)
        return x * torch.tensor(self.config.hidden_size ** 0.5, dtype=x.dtype)


def _config(cfg: dict) -> dict:
    """What Gemma 2 and 3 read alike."""
    return {**config_fields.standard(cfg), **config_fields.attention_bias(cfg),
            "hidden_act": cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh",
            "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)),
            "attn_softcap": cfg.get("attn_logit_softcapping"),
            "final_softcap": cfg.get("final_logit_softcapping"),
            "query_pre_attn_scalar": cfg.get("query_pre_attn_scalar", 256)}


def gemma2_config(arch: str, cfg: dict) -> dict:
    """config.json -> ModelConfig fields as transformers reads Gemma 2: odd layers slide."""
    return {**_config(cfg), **config_fields.rope(cfg),
            **config_fields.window_pattern(cfg, lambda n: (n + 1) % 2)}


def gemma3_config(arch: str, cfg: dict) -> dict:
    """config.json -> ModelConfig fields as transformers reads Gemma 3: rope_parameters per
    layer type (or rope_theta and rope_local_base_freq), all but every sixth layer sliding."""
    max_pos = config_fields.max_positions(cfg)
    rope_all = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    per_type = rope_all if "full_attention" in rope_all or "sliding_attention" in rope_all else None
    rope = dict((per_type or {}).get("full_attention") or ({} if per_type else rope_all))
    local = dict((per_type or {}).get("sliding_attention") or {})
    local_scaling = read_rope_scaling(local, cfg, max_pos)
    pattern = cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6))
    return {**_config(cfg), "qk_norm": True,
            "rope_theta": float(rope.get("rope_theta", cfg.get("rope_theta", 1_000_000.0))),
            "rope_scaling": read_rope_scaling(rope, cfg, max_pos),
            "local_rope_theta": float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10_000.0))),
            "local_rope_scaling": local_scaling,
            **config_fields.window_pattern(cfg, lambda n: (n + 1) % pattern)}


_SHARDING = {**SHARDING, "pre_feedforward_layernorm": "replicated", "post_feedforward_layernorm": "replicated"}
_REFUSED = (*REFUSED, "use_bidirectional_attention")
GEMMA2 = Family(name="gemma2", architectures=("Gemma2ForCausalLM",), model_class=GemmaForCausalLM,
                config=gemma2_config, weights=GemmaForCausalLM.weight_shapes, sharding=_SHARDING,
                refused=_REFUSED)
GEMMA3 = Family(name="gemma3", architectures=("Gemma3ForCausalLM",), model_class=GemmaForCausalLM,
                config=gemma3_config, weights=GemmaForCausalLM.weight_shapes, sharding=_SHARDING,
                refused=_REFUSED)
