"""The model's architecture, read from a Hugging Face config.json."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from pagedserve.executor.errors import ModelLoadError
from pagedserve.executor.models import registry
from pagedserve.executor.rope_scaling import ROPE_TYPES, RopeScaling

ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
LAYER_TYPES = ("full_attention", "sliding_attention")
IMPLS = ("native", "transformers")
MODEL_IMPLS = ("auto", *IMPLS)  # --model-impl; auto: native where the architecture has a family


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # q, k and v projections have a bias (Qwen2; Llama attention_bias)
    o_bias: bool = False  # the output projection has a bias (Llama attention_bias)
    qk_norm: bool = False  # per-head RMSNorm of q and k before rotary (Qwen3, Gemma 3)
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str | None = None  # the checkpoint's dtype, informational
    # Sliding-window attention: the window (positions a query sees, itself included) on the
    # layers whose layer_types entry is "sliding_attention"; None: every layer is global.
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    hidden_act: str = "silu"
    attn_softcap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_softcap: float | None = None  # Gemma 2: logits -> cap * tanh(logits / cap)
    query_pre_attn_scalar: float | None = None  # Gemma: attention scale is its -1/2 power
    # Gemma 3's sliding layers have their own rotary base and scaling
    local_rope_theta: float | None = None
    local_rope_scaling: RopeScaling | None = None
    num_experts: int = 0  # Mixtral: experts per layer, top-k routed
    num_experts_per_tok: int = 0
    # "native": a family's decoder computes it (pagedserve/executor/models/registry.py); "transformers":
    # Transformers' own modeling code (pagedserve/executor/transformers_config.py, models/transformers_backend.py)
    impl: str = "native"

    def __post_init__(self) -> None:
        if self.impl not in IMPLS:
            raise ValueError(f"impl {self.impl!r} is not one of " + ", ".join(IMPLS))
        if self.impl == "transformers":
            return
        family = registry.for_architecture(self.architecture)
        if family is None:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: "
                + ", ".join(registry.architectures())
            )
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "intermediate_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        for rs in (self.rope_scaling, self.local_rope_scaling):
            if rs is not None and rs.rope_type not in ROPE_TYPES:
                raise ValueError(
                    f"rope_scaling type {rs.rope_type!r} is not supported; supported: " + ", ".join(ROPE_TYPES)
                )
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; supported: " + ", ".join(ACTIVATIONS))
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
            for t in self.layer_types:
                if t not in LAYER_TYPES:
                    raise ValueError(f"layer_types entry {t!r} is not supported; supported: " + ", ".join(LAYER_TYPES))
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be positive, got {self.sliding_window}")
        family.validate(self)

    @property
    def family(self) -> str:
        """The name of the native family that computes it (registry.py), or "transformers"."""
        return "transformers" if self.impl == "transformers" else registry.for_architecture(self.architecture).name

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attn_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_window(self, n: int) -> int | None:
        """Layer n's sliding window, or None when it attends to the whole context."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[n] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def kv_window(self) -> int | None:
        """The window when every layer has one (a position older than it is read by no layer)."""
        windows = [self.layer_window(n) for n in range(self.num_layers)]
        return None if any(w is None for w in windows) else max(windows)

    @property
    def max_model_len(self) -> int:
        """The longest context computed as the reference would: longrope uses its short
        factors only, so it stops at original_max_position_embeddings."""
        if self.rope_scaling.rope_type == "longrope":
            return min(self.max_position_embeddings, self.rope_scaling.original_max_position_embeddings)
        return self.max_position_embeddings

    @classmethod
    def from_dict(cls, cfg: dict) -> "ModelConfig":
        """The fields as the architecture's family reads them (registry.py). Raises ValueError
        naming the field for anything that changes the computation and is not implemented (a
        rope type, an activation, quantization, partial rotary, ...)."""
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else f"<none> (model_type={cfg.get('model_type')!r})"
        family = registry.for_architecture(arch)
        if family is None:
            raise ValueError(f"unsupported architecture {arch!r}; supported: " + ", ".join(registry.architectures())
                             + " (other causal LMs: --model-impl transformers or auto)")
        if cfg.get("quantization_config"):
            method = (cfg["quantization_config"] or {}).get("quant_method", "?")
            raise ValueError(f"quantization_config (quant_method {method!r}) is not supported; "
                             "use unquantized weights")
        for key in family.refused:
            if cfg.get(key):
                raise ValueError(f"{key}=true is not supported")
        return cls(architecture=arch, **family.config(arch, cfg))

    @classmethod
    def from_dir(cls, model_dir: str, impl: str = "native") -> "ModelConfig":
        """Read `model_dir/config.json`, and the eos ids of generation_config.json if present,
        for `impl` (MODEL_IMPLS; auto: native if a family has the architecture, else transformers).

        Raises ModelLoadError naming the file for a missing, unreadable or unsupported config.
        """
        path = os.path.join(model_dir, "config.json")
        try:
            with open(path) as f:
                cfg = json.load(f)
        except FileNotFoundError:
            raise ModelLoadError(f"{path}: not found; a model directory needs a config.json") from None
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{path}: not a readable JSON config ({e})") from e
        if impl not in MODEL_IMPLS:
            raise ModelLoadError(f"--model-impl {impl!r}: choose one of " + ", ".join(MODEL_IMPLS))
        if impl == "auto":
            native = registry.for_architecture((cfg.get("architectures") or [None])[0]) is not None
            impl = "native" if native else "transformers"
        try:
            if impl == "transformers":
                from pagedserve.executor.transformers_config import transformers_config

                config = transformers_config(cfg, model_dir)
            else:
                config = cls.from_dict(cfg)
        except KeyError as e:
            raise ModelLoadError(f"{path}: missing required field {e.args[0]!r}") from e
        except ValueError as e:
            raise ModelLoadError(f"{path}: {e}") from e
        gen_path = os.path.join(model_dir, "generation_config.json")
        if os.path.exists(gen_path):
            try:
                with open(gen_path) as f:
                    eos = json.load(f).get("eos_token_id")
            except (OSError, ValueError) as e:
                raise ModelLoadError(f"{gen_path}: not a readable JSON file ({e})") from e
            for i in [] if eos is None else ([eos] if isinstance(eos, int) else eos):
                if i not in config.eos_token_ids:
                    config.eos_token_ids.append(i)
        return config

