"""What a native model family declares in its own module (pagedserve/executor/models/<x>.py),
for the registry (registry.py) to hand to the code that reads checkpoints and splits them:

- name, architectures: the config.json `architectures` it computes;
- model_class: its decoder, built as model_class(config, weights, on_built);
- config(arch, cfg) -> ModelConfig fields, all of them but `architecture`: how it reads a
  config.json (config_fields.py has the readings families share); raises ValueError naming
  a field whose value it does not implement;
- refused: config.json keys whose true value it does not implement;
- validate(config): raises ValueError for a ModelConfig it cannot compute;
- weights(config) -> {Hugging Face tensor name: shape}: every tensor its checkpoint holds;
- sharding: each tensor's leaf (the name's component before ".weight" or ".bias") -> how a
  tensor-parallel rank cuts it, one of CUTS (pagedserve/executor/sharding.py);
- gguf: how pagedserve/executor/gguf_convert.py reads its GGUF files, or None.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

# tensor-parallel cuts (pagedserve/executor/sharding.py says what each keeps)
CUTS = ("replicated", "vocab_rows", "q_rows", "kv_rows", "qkv_rows", "q_columns", "mlp_rows",
        "mlp_columns", "gate_up_rows")


def _accepts_all(config: Any) -> None:
    return None


@dataclass(frozen=True)
class Gguf:
    """A family's GGUF files: llama.cpp's names and metadata -> a Hugging Face directory."""

    architectures: Mapping[str, str]  # general.architecture -> config.json architecture
    global_names: Mapping[str, str]  # GGUF tensor name -> Hugging Face tensor name
    layer_names: Mapping[str, str]  # blk.N.<key> -> model.layers.N.<value>
    # config(get) -> config.json fields; get(key, default=None) reads the metadata "<arch>.<key>"
    # (a ModelLoadError when absent without a default); ValueError for a value not implemented
    config: Callable[[Callable[..., Any]], dict]
    permuted: tuple[str, ...] = ()  # architectures whose q/k rows llama.cpp interleaved


@dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]
    model_class: type
    config: Callable[[str, dict], dict]
    weights: Callable[[Any], dict[str, tuple[int, ...]]]
    sharding: Mapping[str, str]
    refused: tuple[str, ...] = ()
    validate: Callable[[Any], None] = _accepts_all
    gguf: Gguf | None = None

    def __post_init__(self) -> None:
        where = f"model family {self.name!r}"
        if not self.name or not self.architectures:
            raise ValueError(f"{where}: declare a name and at least one architecture")
        for part in ("config", "weights", "validate"):
            if not callable(getattr(self, part)):
                raise TypeError(f"{where}: {part} must be callable")
        for method in ("forward", "compute_logits"):
            if not callable(getattr(self.model_class, method, None)):
                raise TypeError(f"{where}: model_class {self.model_class.__name__} has no {method}()")
        unknown = sorted({cut for cut in self.sharding.values() if cut not in CUTS})
        if unknown:
            raise ValueError(f"{where}: sharding names unknown cuts {unknown}; known: " + ", ".join(CUTS))
        if self.gguf is not None:
            strays = sorted(a for a in self.gguf.architectures.values() if a not in self.architectures)
            if strays:
                raise ValueError(f"{where}: GGUF files map to {strays}, not architectures of this family")
