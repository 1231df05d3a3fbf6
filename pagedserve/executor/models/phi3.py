"""Phi-3 over the paged KV pool: the shared decoder (decoder.py) with the checkpoint's fused
projections (qkv_proj, gate_up_proj, gate rows first) and longrope scaling
(pagedserve/executor/rope_scaling.py); its family declaration (family.py)."""
from __future__ import annotations

from pagedserve.executor.linear import Linear
from pagedserve.executor.models import config_fields
from pagedserve.executor.models.decoder import REFUSED, SHARDING, DecoderForCausalLM, DecoderLayer
from pagedserve.executor.models.family import Family


class Phi3DecoderLayer(DecoderLayer):
    @staticmethod
    def qkv_shapes(c, a: str) -> dict[str, tuple[int, ...]]:
        return {a + "qkv_proj.weight": (c.q_size + 2 * c.kv_size, c.hidden_size)}

    def qkv_weight(self, w, a: str):
        return w[a + "qkv_proj.weight"]  # rows: q, k, v

    @staticmethod
    def mlp_shapes(c, prefix: str) -> dict[str, tuple[int, ...]]:
        m, h, i = prefix + "mlp.", c.hidden_size, c.intermediate_size
        return {m + "gate_up_proj.weight": (2 * i, h), m + "down_proj.weight": (h, i)}

    def init_mlp(self, w, prefix: str) -> None:
        m = prefix + "mlp."
        self.gate_up = Linear(w[m + "gate_up_proj.weight"])
        self.down = Linear(w[m + "down_proj.weight"])


class Phi3ForCausalLM(DecoderForCausalLM):
    layer_class = Phi3DecoderLayer


def config(arch: str, cfg: dict) -> dict:
    """config.json -> ModelConfig fields, as transformers reads Phi-3: the window on every layer."""
    return {**config_fields.standard(cfg), **config_fields.rope(cfg), **config_fields.attention_bias(cfg),
            **config_fields.window_everywhere(cfg), "hidden_act": cfg.get("hidden_act", "silu")}


_SHARDING = {k: v for k, v in SHARDING.items() if k not in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")}
FAMILY = Family(name="phi3", architectures=("Phi3ForCausalLM",), model_class=Phi3ForCausalLM, config=config,
                weights=Phi3ForCausalLM.weight_shapes, sharding={**_SHARDING, "qkv_proj": "qkv_rows",
                                                                 "gate_up_proj": "gate_up_rows"},
                refused=REFUSED)
