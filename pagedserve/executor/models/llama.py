"""The Llama family: Llama, Mistral, Qwen2 and Qwen3 on the shared decoder (decoder.py), and
how their config.json, safetensors and GGUF files are read (family.py)."""
from __future__ import annotations

from pagedserve.executor.models import config_fields
from pagedserve.executor.models.decoder import REFUSED, SHARDING, DecoderForCausalLM, DecoderLayer, rms_norm
from pagedserve.executor.models.family import Family, Gguf


class LlamaForCausalLM(DecoderForCausalLM):
    layer_class = DecoderLayer
    final_norm = staticmethod(rms_norm)  # the shared decoder's, as every Llama layer's (llama.rms_norm)


def config(arch: str, cfg: dict) -> dict:
    """config.json -> ModelConfig fields, as transformers reads each of the four."""
    fields = {**config_fields.standard(cfg), **config_fields.rope(cfg), **config_fields.attention_bias(cfg),
              "hidden_act": cfg.get("hidden_act", "silu")}
    if arch == "LlamaForCausalLM":  # transformers' Llama has no sliding window
        return fields
    if arch == "MistralForCausalLM":
        return {**fields, **config_fields.window_everywhere(cfg)}
    if arch == "Qwen2ForCausalLM":  # q, k, v biased, o not, whatever attention_bias says
        fields.update(qkv_bias=True, o_bias=False)
    else:
        fields.update(qk_norm=True)  # Qwen3
    if cfg.get("use_sliding_window", False):
        fields.update(config_fields.window_pattern(cfg, lambda n: n >= cfg.get("max_window_layers", 28)))
    return fields


def gguf_config(get) -> dict:
    """GGUF metadata -> config.json fields (the tokenizer's and the file's are gguf_convert's)."""
    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    fields = {
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length")),
        "hidden_act": "silu",
    }
    if get("rope.scaling.type", "none") != "none":
        raise ValueError("rope scaling in GGUF files is not supported")
    return fields


GGUF = Gguf(
    architectures={"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"},
    global_names={
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    },
    layer_names={
        "attn_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "attn_q.weight": "self_attn.q_proj.weight",
        "attn_k.weight": "self_attn.k_proj.weight",
        "attn_v.weight": "self_attn.v_proj.weight",
        "attn_q.bias": "self_attn.q_proj.bias",
        "attn_k.bias": "self_attn.k_proj.bias",
        "attn_v.bias": "self_attn.v_proj.bias",
        "attn_output.weight": "self_attn.o_proj.weight",
        "attn_q_norm.weight": "self_attn.q_norm.weight",
        "attn_k_norm.weight": "self_attn.k_norm.weight",
        "ffn_gate.weight": "mlp.gate_proj.weight",
        "ffn_up.weight": "mlp.up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight",
    },
    config=gguf_config,
    permuted=("llama",),
)

FAMILY = Family(
    name="llama",
    architectures=("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"),
    model_class=LlamaForCausalLM,
    config=config,
    weights=LlamaForCausalLM.weight_shapes,
    sharding=SHARDING,
    refused=REFUSED,
    gguf=GGUF,
)
