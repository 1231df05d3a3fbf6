"""The ModelConfig of a model served through Transformers' own modeling code (--model-impl
transformers; pagedserve/executor/models/transformers_backend.py).

`transformers_config(cfg, model_dir)` reads the KV geometry (layers, attention and KV heads,
head size) and the vocabulary from the Hugging Face config generically, and refuses, naming
the field, what the backend cannot serve: encoder-decoders, bidirectional attention, remote
code, quantized weights, and attention other than causal softmax attention over one K and V
per layer (latent attention, ALiBi, chunked attention, recurrent or state-space layers).
Sliding windows are not read here: the backend records each layer's own at load.
"""
from __future__ import annotations

# config field -> why the backend cannot serve a model that sets it
NOT_SERVED = {
    "kv_lora_rank": "multi-head latent attention (MLA) caches a compressed latent, not K and V",
    "alibi": "ALiBi position biases are not applied by the paged kernels",
    "use_alibi": "ALiBi position biases are not applied by the paged kernels",
    "attention_chunk_size": "chunked attention is not applied by the paged kernels",
    "ssm_state_size": "recurrent (state-space) layers keep a state the pool does not hold",
    "mamba_d_state": "recurrent (state-space) layers keep a state the pool does not hold",
    "layers_block_type": "recurrent or hybrid layers keep a state the pool does not hold",
    "hybrid_override_pattern": "recurrent or hybrid layers keep a state the pool does not hold",
    "use_bidirectional_attention": "the paged kernels attend causally only",
}
LAYER_TYPES = ("full_attention", "sliding_attention")
KV_HEAD_FIELDS = ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num")


def transformers_config(cfg: dict, model_dir: str):
    """A ModelConfig (impl "transformers") for config.json's `cfg`; ValueError naming the field
    and what to do for what the backend cannot serve."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from pagedserve.executor.model_config import ModelConfig

    model_type = cfg.get("model_type")
    archs = cfg.get("architectures") or []
    if cfg.get("auto_map"):
        raise ValueError("auto_map: the model's code is its own (trust_remote_code), which pagedserve "
                         "does not run; use a model whose architecture transformers implements")
    expected = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if expected is None:
        raise ValueError(f"model_type {model_type!r} has no causal language model in transformers "
                         "(encoder-decoder, encoder-only or not known to this transformers version)")
    arch = archs[0] if archs else expected
    if arch != expected:
        raise ValueError(f"architectures names {arch!r}, but model_type {model_type!r} is transformers' "
                         f"{expected}; make the two agree")
    if cfg.get("quantization_config"):
        method = (cfg["quantization_config"] or {}).get("quant_method", "?")
        raise ValueError(f"quantization_config (quant_method {method!r}) is not supported; use unquantized weights")
    hf = AutoConfig.from_pretrained(model_dir)
    if getattr(hf, "is_encoder_decoder", False):
        raise ValueError("is_encoder_decoder=true: the Transformers backend serves decoder-only models")
    if getattr(hf, "is_causal", True) is False:
        raise ValueError("is_causal=false: the paged kernels attend causally only")
    for name, why in NOT_SERVED.items():
        if getattr(hf, name, None):
            raise ValueError(f"{name}={getattr(hf, name)!r}: {why}; no Transformers backend for {arch}")
    for t in getattr(hf, "layer_types", None) or []:
        if t not in LAYER_TYPES:
            raise ValueError(f"layer_types entry {t!r}: the Transformers backend serves "
                             + " and ".join(LAYER_TYPES) + f" layers only; no Transformers backend for {arch}")
    heads = _field(hf, "num_attention_heads")
    hidden = _field(hf, "hidden_size")
    kv_heads = next((getattr(hf, f) for f in KV_HEAD_FIELDS if getattr(hf, f, None)), None)
    if kv_heads is None:
        kv_heads = 1 if getattr(hf, "multi_query", False) else heads
    max_pos = getattr(hf, "max_position_embeddings", None)
    if not max_pos:
        raise ValueError("max_position_embeddings: not in config.json; add the model's maximum context length")
    eos = getattr(hf, "eos_token_id", None)
    return ModelConfig(
        architecture=arch,
        vocab_size=_field(hf, "vocab_size"),
        hidden_size=hidden,
        num_layers=_field(hf, "num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=getattr(hf, "head_dim", None) or hidden // heads,
        intermediate_size=getattr(hf, "intermediate_size", None) or 0,  # not used by the backend
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
        torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "") or None,
        impl="transformers",
    )


def _field(hf, name: str) -> int:
    value = getattr(hf, name, None)
    if not value:
        raise ValueError(f"{name}: not in config.json (nor a default of {type(hf).__name__}); add it")
    return int(value)
