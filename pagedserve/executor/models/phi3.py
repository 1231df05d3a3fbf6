"""Phi-3 over the paged KV pool: the shared decoder (decoder.py) with the checkpoint's fused
projections (qkv_proj, gate_up_proj, gate rows first) and longrope scaling
(model_config.RopeScaling)."""
from __future__ import annotations

from pagedserve.executor.linear import Linear
from pagedserve.executor.models.decoder import DecoderForCausalLM, DecoderLayer


class Phi3DecoderLayer(DecoderLayer):
    def qkv_weight(self, w, a: str):
        return w[a + "qkv_proj.weight"]  # rows: q, k, v

    def init_mlp(self, w, prefix: str) -> None:
        m = prefix + "mlp."
        self.gate_up = Linear(w[m + "gate_up_proj.weight"])
        self.down = Linear(w[m + "down_proj.weight"])


class Phi3ForCausalLM(DecoderForCausalLM):
    layer_class = Phi3DecoderLayer
