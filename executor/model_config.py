"""The model's architecture, read from a Hugging Face config.json."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from executor.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


@dataclass
class RopeScaling:
    """Rotary-embedding frequency scaling; only "llama3" changes anything."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


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
    qk_norm: bool = False  # per-head RMSNorm of q and k before rotary (Qwen3)
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str | None = None  # the checkpoint's dtype, informational
    # Mistral/Qwen2 sliding-window attention is ignored: every layer attends to the whole
    # context, which is exact for sequences shorter than the window.
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: "
                + ", ".join(SUPPORTED_ARCHITECTURES)
            )
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "intermediate_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.rope_scaling.rope_type not in ("default", "llama3"):
            raise ValueError(
                f"unsupported rope scaling {self.rope_scaling.rope_type!r}; supported: default, llama3"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dict(cls, cfg: dict) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else f"<none> (model_type={cfg.get('model_type')!r})"
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
        if rope_type == "llama3":
            scaling = RopeScaling(
                "llama3",
                float(rope["factor"]),
                float(rope["low_freq_factor"]),
                float(rope["high_freq_factor"]),
                int(rope["original_max_position_embeddings"]),
            )
        else:
            scaling = RopeScaling(rope_type)
        is_qwen2 = arch == "Qwen2ForCausalLM"
        attention_bias = bool(cfg.get("attention_bias", False))
        if cfg.get("mlp_bias"):
            raise ValueError("mlp_bias=true is not supported")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg.get('hidden_act')!r} is not supported; expected silu")
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        use_window = cfg.get("use_sliding_window", True)
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            intermediate_size=cfg["intermediate_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=attention_bias and not is_qwen2,
            qk_norm=arch == "Qwen3ForCausalLM",
            eos_token_ids=eos_ids,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            sliding_window=cfg.get("sliding_window") if use_window else None,
        )

    @classmethod
    def from_dir(cls, model_dir: str) -> "ModelConfig":
        """Read `model_dir/config.json`, and the eos ids of generation_config.json if present.

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
        try:
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
