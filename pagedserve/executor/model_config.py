"""The model's architecture, read from a Hugging Face config.json."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from pagedserve.executor.errors import ModelLoadError
from pagedserve.executor.rope_scaling import ROPE_TYPES, RopeScaling, read_rope_scaling

# architecture -> family: the decoder class that computes it (pagedserve/executor/models/)
FAMILIES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
    "MixtralForCausalLM": "mixtral",
}
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)
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
    # "native": a decoder class of pagedserve/executor/models computes it (family); "transformers":
    # Transformers' own modeling code (pagedserve/executor/transformers_config.py, models/transformers_backend.py)
    impl: str = "native"

    def __post_init__(self) -> None:
        if self.impl not in IMPLS:
            raise ValueError(f"impl {self.impl!r} is not one of " + ", ".join(IMPLS))
        if self.impl == "transformers":
            return
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
        if self.family == "mixtral" and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be in "
                             f"1..num_local_experts ({self.num_experts})")

    @property
    def family(self) -> str:
        return "transformers" if self.impl == "transformers" else FAMILIES[self.architecture]

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
        """Raises ValueError naming the field for anything that changes the computation and is
        not implemented (a rope type, an activation, quantization, partial rotary, ...)."""
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else f"<none> (model_type={cfg.get('model_type')!r})"
        if arch not in FAMILIES:
            raise ValueError(f"unsupported architecture {arch!r}; supported: " + ", ".join(SUPPORTED_ARCHITECTURES)
                             + " (other causal LMs: --model-impl transformers or auto)")
        family = FAMILIES[arch]
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        num_layers = cfg["num_hidden_layers"]
        max_pos = cfg.get("max_position_embeddings", 2048)
        if cfg.get("quantization_config"):
            method = (cfg["quantization_config"] or {}).get("quant_method", "?")
            raise ValueError(f"quantization_config (quant_method {method!r}) is not supported; "
                             "use unquantized weights")
        if cfg.get("mlp_bias"):
            raise ValueError("mlp_bias=true is not supported")
        if family in ("gemma2", "gemma3"):
            act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
            if cfg.get("use_bidirectional_attention"):
                raise ValueError("use_bidirectional_attention=true is not supported")
        else:
            act = cfg.get("hidden_act", "silu")
        if act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {act!r} is not supported; supported: " + ", ".join(ACTIVATIONS))
        rope_all = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        local_theta = local_scaling = None
        if family == "gemma3":
            per_type = rope_all if "full_attention" in rope_all or "sliding_attention" in rope_all else None
            rope = dict((per_type or {}).get("full_attention") or ({} if per_type else rope_all))
            local = dict((per_type or {}).get("sliding_attention") or {})
            theta = rope.get("rope_theta", cfg.get("rope_theta", 1_000_000.0))
            local_theta = float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10_000.0)))
            local_scaling = read_rope_scaling(local, cfg, max_pos)
        else:
            rope = rope_all
            theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = read_rope_scaling(rope, cfg, max_pos)
        is_qwen2 = arch == "Qwen2ForCausalLM"
        attention_bias = bool(cfg.get("attention_bias", False))
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        window, layer_types = _sliding(cfg, arch, family, num_layers)
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            intermediate_size=cfg["intermediate_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", family in ("gemma2", "gemma3"))),
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=attention_bias and not is_qwen2,
            qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"),
            eos_token_ids=eos_ids,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            sliding_window=window,
            layer_types=layer_types,
            hidden_act=act,
            attn_softcap=cfg.get("attn_logit_softcapping") if family in ("gemma2", "gemma3") else None,
            final_softcap=cfg.get("final_logit_softcapping") if family in ("gemma2", "gemma3") else None,
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar", 256) if family in ("gemma2", "gemma3") else None,
            local_rope_theta=local_theta,
            local_rope_scaling=local_scaling,
            num_experts=cfg.get("num_local_experts", 0) if family == "mixtral" else 0,
            num_experts_per_tok=cfg.get("num_experts_per_tok", 0) if family == "mixtral" else 0,
        )

    @classmethod
    def from_dir(cls, model_dir: str, impl: str = "native") -> "ModelConfig":
        """Read `model_dir/config.json`, and the eos ids of generation_config.json if present,
        for `impl` (MODEL_IMPLS; auto: native if FAMILIES has the architecture, else transformers).

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
            impl = "native" if (cfg.get("architectures") or [None])[0] in FAMILIES else "transformers"
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


def _sliding(cfg: dict, arch: str, family: str, num_layers: int) -> tuple[int | None, list[str] | None]:
    """(window, layer types) as transformers computes them for each family."""
    window = cfg.get("sliding_window")
    if arch == "LlamaForCausalLM" or window is None:
        return None, None  # transformers' Llama has no sliding window
    window = int(window)
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        if not cfg.get("use_sliding_window", False):
            return None, None
        types = cfg.get("layer_types") or [
            "sliding_attention" if i >= cfg.get("max_window_layers", 28) else "full_attention"
            for i in range(num_layers)
        ]
        return window, list(types)
    if family == "gemma2":
        return window, list(cfg.get("layer_types") or [
            "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)])
    if family == "gemma3":
        pattern = cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6))
        return window, list(cfg.get("layer_types") or [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)])
    return window, None  # Mistral, Mixtral, Phi-3: every layer (transformers ignores layer_types)
