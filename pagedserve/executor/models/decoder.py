"""The decoder the native families share (llama.py, gemma.py, phi3.py, mixtral.py), over the
paged KV pool, with the Hugging Face names and shapes of the weights it reads and how a
tensor-parallel rank cuts each (SHARDING).

All tokens of a step are packed in one dimension T. Each layer does one fused QKV
projection and one fused gate/up projection; per-sequence attention is the kernels'
business (`pagedserve.kernels.paged_attention` walks each sequence's block table, within the layer's
sliding window when it has one).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve import kernels
from pagedserve.executor.attention_metadata import AttentionMetadata
from pagedserve.executor.linear import Linear
from pagedserve.executor.models.rotary import apply_rotary, rotary_inv_freq
from pagedserve.kernels import fused, fused_cpu

if TYPE_CHECKING:
    from pagedserve.executor.model_config import ModelConfig

# each weight's leaf -> how a tensor-parallel rank cuts it (family.py, pagedserve/executor/sharding.py)
SHARDING = {"embed_tokens": "vocab_rows", "lm_head": "vocab_rows", "norm": "replicated",
            "input_layernorm": "replicated", "post_attention_layernorm": "replicated",
            "q_proj": "q_rows", "k_proj": "kv_rows", "v_proj": "kv_rows", "o_proj": "q_columns",
            "q_norm": "replicated", "k_norm": "replicated",
            "gate_proj": "mlp_rows", "up_proj": "mlp_rows", "down_proj": "mlp_columns"}
REFUSED = ("mlp_bias",)  # config.json keys whose true value the decoder does not implement


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, like the reference implementation, then cast back."""
    if fused.applies(x) and x.is_contiguous():  # one pass: Triton on CUDA, C++ on the CPU (float32)
        return fused.rms_norm(x, weight, eps)
    if x.dtype != torch.float32:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(x.dtype)
    # float32: the same arithmetic, in place on the temporaries (fewer ops and allocations)
    scale = x.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
    return (x * scale).mul_(weight)


def activation(name: str):
    if name == "gelu_pytorch_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    return F.silu


class DecoderLayer(nn.Module):
    norm = staticmethod(rms_norm)  # Gemma: (1 + w) in float32

    def __init__(self, config: ModelConfig, w: dict[str, torch.Tensor], prefix: str, index: int = 0):
        super().__init__()
        self.config = config
        self.window = config.layer_window(index)
        self.rope_key = "local" if self.window is not None and config.local_rope_theta is not None else "global"
        self.act = activation(config.hidden_act)
        a = prefix + "self_attn."
        p = lambda t: nn.Parameter(t, requires_grad=False)  # noqa: E731
        self.input_norm = p(self.norm_weight(w[prefix + "input_layernorm.weight"]))
        self.post_attn_norm = p(self.norm_weight(w[prefix + "post_attention_layernorm.weight"]))
        qkv_bias = None
        if config.qkv_bias:
            qkv_bias = torch.cat([w[a + "q_proj.bias"], w[a + "k_proj.bias"], w[a + "v_proj.bias"]])
        self.qkv = Linear(self.qkv_weight(w, a), qkv_bias)
        self.o = Linear(w[a + "o_proj.weight"], w[a + "o_proj.bias"] if config.o_bias else None)
        self.q_norm = p(self.norm_weight(w[a + "q_norm.weight"])) if config.qk_norm else None
        self.k_norm = p(self.norm_weight(w[a + "k_norm.weight"])) if config.qk_norm else None
        self.init_mlp(w, prefix)

    @classmethod
    def weight_shapes(cls, c: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
        """The layer's tensors as __init__ reads them, by Hugging Face name, with their shapes."""
        h, a = c.hidden_size, prefix + "self_attn."
        shapes = {prefix + "input_layernorm.weight": (h,), prefix + "post_attention_layernorm.weight": (h,),
                  **cls.qkv_shapes(c, a), a + "o_proj.weight": (h, c.q_size)}
        if c.o_bias:
            shapes[a + "o_proj.bias"] = (h,)
        if c.qk_norm:
            shapes[a + "q_norm.weight"] = shapes[a + "k_norm.weight"] = (c.head_dim,)
        return {**shapes, **cls.mlp_shapes(c, prefix)}

    @staticmethod
    def norm_weight(weight: torch.Tensor) -> torch.Tensor:
        return weight

    @staticmethod
    def qkv_shapes(c: ModelConfig, a: str) -> dict[str, tuple[int, ...]]:
        shapes = {}
        for proj, rows in (("q", c.q_size), ("k", c.kv_size), ("v", c.kv_size)):
            shapes[f"{a}{proj}_proj.weight"] = (rows, c.hidden_size)
            if c.qkv_bias:
                shapes[f"{a}{proj}_proj.bias"] = (rows,)
        return shapes

    def qkv_weight(self, w, a: str) -> torch.Tensor:
        return torch.cat([w[a + "q_proj.weight"], w[a + "k_proj.weight"], w[a + "v_proj.weight"]])

    @staticmethod
    def mlp_shapes(c: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
        m, h, i = prefix + "mlp.", c.hidden_size, c.intermediate_size
        return {m + "gate_proj.weight": (i, h), m + "up_proj.weight": (i, h), m + "down_proj.weight": (h, i)}

    def init_mlp(self, w, prefix: str) -> None:
        m = prefix + "mlp."
        self.gate_up = Linear(torch.cat([w[m + "gate_proj.weight"], w[m + "up_proj.weight"]]))
        self.down = Linear(w[m + "down_proj.weight"])

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        if self.act is F.silu and (gated := self.gate_up.silu_gated(h)) is not None:
            return self.down(gated)  # SiLU-and-multiply applied in the projection (C++ "dot" rows)
        gate_up = self.gate_up(h)
        if self.act is F.silu and fused.silu_applies(gate_up):  # one pass: Triton on CUDA, C++ on the CPU
            return self.down(fused.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down(self.act(gate).mul_(up))

    def attention(self, h, cos, sin, k_cache, v_cache, meta: AttentionMetadata):
        """The attention block on the normed input h [T, hidden]: o_proj's output."""
        c = self.config
        t = h.shape[0]
        qkv = self.qkv(h)
        heads = c.num_heads + c.num_kv_heads
        if self.q_norm is not None:
            q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], -1)
            q = self.norm(q.view(t, c.num_heads, c.head_dim), self.q_norm, c.rms_norm_eps)
            k = self.norm(k.view(t, c.num_kv_heads, c.head_dim), self.k_norm, c.rms_norm_eps)
            qk = torch.cat((q, k), 1)
        else:  # q and k side by side in one view: one rotary pass over both
            qk = qkv[:, : c.q_size + c.kv_size].view(t, heads, c.head_dim)
        v = qkv[:, c.q_size + c.kv_size:].view(t, c.num_kv_heads, c.head_dim)
        if fused.rotary_store_applies(qk, k_cache, v_cache):  # rotary in the K/V store (Triton or C++)
            q = fused.rotary_store_kv_(qk, v, cos, sin, k_cache, v_cache, meta.slot_mapping)
        else:
            if fused_cpu.applies(qk):  # CPU float32: in place, one C++ pass (qk is this step's own)
                fused_cpu.rotary_(qk, cos, sin)
            else:
                qk = apply_rotary(qk, cos, sin)
            q, k = qk.split([c.num_heads, c.num_kv_heads], 1)
            kernels.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        o = meta.attend(q, k_cache, v_cache, c.attn_scale, window=self.window, softcap=c.attn_softcap)
        return self.o(o.reshape(t, c.q_size))

    def forward(self, x, cos, sin, k_cache, v_cache, meta: AttentionMetadata):
        c = self.config
        h = rms_norm(x, self.input_norm, c.rms_norm_eps)
        a = self.attention(h, cos, sin, k_cache, v_cache, meta)
        if fused.applies(a):  # a += x and the norm in one pass (Triton on CUDA, C++ on the CPU)
            h = fused.add_rms_norm_(a, x, self.post_attn_norm, c.rms_norm_eps)
            x = a
        else:
            x = x + a  # x is the caller's: not in place
            h = rms_norm(x, self.post_attn_norm, c.rms_norm_eps)
        return x.add_(self.mlp(h))


class DecoderForCausalLM(nn.Module):
    """forward(input_ids [T], positions [T], meta, kv_pool) -> final hidden states [T, H];
    compute_logits(hidden [N, H]) -> float32 logits [N, vocab].

    on_built, if given, is called with each decoder layer as soon as it is built and then with
    the whole model (pagedserve.executor.linear_backend.Planner.place routes their linear layers there,
    so a layer's dense weights can be freed before the next layer is read)."""

    layer_class = DecoderLayer
    final_norm = staticmethod(rms_norm)
    tp = None  # pagedserve.executor.tensor_parallel.Collectives when this is one rank's shard

    def __init__(self, config: ModelConfig, weights: Mapping[str, torch.Tensor],
                 on_built: Callable[[nn.Module], None] | None = None):
        super().__init__()
        self.config = config
        self.embed = nn.Parameter(weights["model.embed_tokens.weight"], requires_grad=False)
        self.layers = nn.ModuleList()
        for n in range(config.num_layers):
            self.layers.append(self.layer_class(config, weights, f"model.layers.{n}.", n))
            if on_built is not None:
                on_built(self.layers[n])
        self.norm = nn.Parameter(self.layer_class.norm_weight(weights["model.norm.weight"]), requires_grad=False)
        self.lm_head = Linear(self.embed if config.tie_word_embeddings else weights["lm_head.weight"])
        self.register_buffer("inv_freq", rotary_inv_freq(config), persistent=False)
        self.rope_scale = config.rope_scaling.attention_factor  # longrope scales cos and sin
        local = None
        if config.local_rope_theta is not None:
            local = rotary_inv_freq(config, config.local_rope_theta, config.local_rope_scaling)
        self.register_buffer("local_inv_freq", local, persistent=False)
        if on_built is not None:
            on_built(self)

    @classmethod
    def weight_shapes(cls, c: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Every tensor the checkpoint must hold, by Hugging Face name, with its shape."""
        shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size), "model.norm.weight": (c.hidden_size,)}
        if not c.tie_word_embeddings:
            shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
        for n in range(c.num_layers):
            shapes.update(cls.layer_class.weight_shapes(c, f"model.layers.{n}."))
        return shapes

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def _cos_sin(self, positions, inv_freq, scale: float = 1.0):
        freqs = positions.float()[:, None] * inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        return cos.to(self.dtype)[:, None, :], sin.to(self.dtype)[:, None, :]

    def embed_tokens(self, input_ids):
        if self.tp is not None:
            return self.tp.embed(input_ids, self.embed)
        return F.embedding(input_ids, self.embed)

    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_pool: torch.Tensor):
        rope = {"global": self._cos_sin(positions, self.inv_freq, self.rope_scale)}
        if self.local_inv_freq is not None:
            rope["local"] = self._cos_sin(positions, self.local_inv_freq)
        x = self.embed_tokens(input_ids)
        for n, layer in enumerate(self.layers):
            cos, sin = rope[layer.rope_key]
            x = layer(x, cos, sin, kv_pool[:, n, 0], kv_pool[:, n, 1], meta)
        return self.final_norm(x, self.norm, self.config.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.tp is not None:
            logits = self.tp.gather_vocab(logits)
        logits = logits.float()
        cap = self.config.final_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
