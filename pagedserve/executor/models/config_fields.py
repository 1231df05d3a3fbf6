"""config.json readings the native families share, as transformers reads them: each family's
config mapping (family.py) composes these with its own fields."""
from __future__ import annotations

from pagedserve.executor.rope_scaling import read_rope_scaling


def standard(cfg: dict) -> dict:
    """The shape, norm, length, eos and dtype fields every Hugging Face decoder config names alike."""
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    eos = cfg.get("eos_token_id")
    return {
        "vocab_size": cfg["vocab_size"],
        "hidden_size": hidden,
        "num_layers": cfg["num_hidden_layers"],
        "num_heads": heads,
        "num_kv_heads": cfg.get("num_key_value_heads") or heads,
        "head_dim": cfg.get("head_dim") or hidden // heads,
        "intermediate_size": cfg["intermediate_size"],
        "rms_norm_eps": cfg.get("rms_norm_eps", 1e-6),
        "max_position_embeddings": max_positions(cfg),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "eos_token_ids": [] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
        "torch_dtype": cfg.get("torch_dtype") or cfg.get("dtype"),
    }


def max_positions(cfg: dict) -> int:
    return cfg.get("max_position_embeddings", 2048)


def rope(cfg: dict) -> dict:
    """rope_theta and rope_scaling from rope_parameters (or the older rope_scaling, rope_theta)."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    return {"rope_theta": float(params.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            "rope_scaling": read_rope_scaling(params, cfg, max_positions(cfg))}


def attention_bias(cfg: dict) -> dict:
    """Llama's attention_bias: q, k, v and o projections all have a bias."""
    bias = bool(cfg.get("attention_bias", False))
    return {"qkv_bias": bias, "o_bias": bias}


def window_everywhere(cfg: dict) -> dict:
    """sliding_window on every layer (Mistral, Mixtral, Phi-3: transformers ignores layer_types)."""
    window = cfg.get("sliding_window")
    return {"sliding_window": None if window is None else int(window), "layer_types": None}


def window_pattern(cfg: dict, sliding) -> dict:
    """sliding_window on the layers config.json's layer_types names sliding, or when it has
    none, on each layer n with sliding(n) true; no window when sliding_window is null."""
    window = cfg.get("sliding_window")
    if window is None:
        return {"sliding_window": None, "layer_types": None}
    types = cfg.get("layer_types") or ["sliding_attention" if sliding(n) else "full_attention"
                                       for n in range(cfg["num_hidden_layers"])]
    return {"sliding_window": int(window), "layer_types": list(types)}
