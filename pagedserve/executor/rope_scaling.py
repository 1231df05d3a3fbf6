"""Rotary-embedding scaling as a Hugging Face config.json states it (RopeScaling), and its
reading (read_rope_scaling), shared by ModelConfig and every family's config mapping."""
from __future__ import annotations

import math
from dataclasses import dataclass

ROPE_TYPES = ("default", "llama3", "linear", "longrope")


@dataclass
class RopeScaling:
    """Rotary-embedding frequency scaling: default, llama3, linear (positions / factor) or
    longrope (Phi-3: per-frequency short factors and a cos/sin scale; the long factors are
    not used, so the maximum length is capped at original_max_position_embeddings)."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: list[float] | None = None
    attention_factor: float = 1.0


def read_rope_scaling(rope: dict, cfg: dict, max_pos: int) -> RopeScaling:
    """`rope`: the rope_parameters (or rope_scaling) entry of config.json `cfg`; raises
    ValueError naming the field for a type or a partial rotary factor not implemented."""
    rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
    rope_type = {"su": "longrope"}.get(rope_type, rope_type)
    for partial in (rope.get("partial_rotary_factor"), cfg.get("partial_rotary_factor")):
        if partial is not None and float(partial) != 1.0:
            raise ValueError(f"partial_rotary_factor={partial} is not supported (only 1.0)")
    if rope_type == "llama3":
        return RopeScaling("llama3", float(rope["factor"]), float(rope["low_freq_factor"]),
                           float(rope["high_freq_factor"]), int(rope["original_max_position_embeddings"]))
    if rope_type == "linear":
        return RopeScaling("linear", float(rope["factor"]))
    if rope_type == "longrope":
        orig = int(rope.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
                   or max_pos)
        factor = float(rope.get("factor") or max_pos / orig)
        attention = rope.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
        return RopeScaling("longrope", factor, original_max_position_embeddings=orig,
                           short_factor=[float(f) for f in rope["short_factor"]], attention_factor=float(attention))
    if rope_type != "default":
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported; supported: " + ", ".join(ROPE_TYPES))
    return RopeScaling()
