"""The Llama family: Llama, Mistral, Qwen2 and Qwen3 on the shared decoder (decoder.py)."""
from __future__ import annotations

from pagedserve.executor.models.decoder import DecoderForCausalLM, DecoderLayer, rms_norm


class LlamaForCausalLM(DecoderForCausalLM):
    layer_class = DecoderLayer
    final_norm = staticmethod(rms_norm)  # the shared decoder's, as every Llama layer's (llama.rms_norm)
