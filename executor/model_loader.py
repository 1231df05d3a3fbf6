"""Build the model from a Hugging Face-style directory."""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from executor.model_config import ModelConfig
from executor.models.gemma import GemmaForCausalLM
from executor.models.llama import LlamaForCausalLM
from executor.models.mixtral import MixtralForCausalLM
from executor.models.phi3 import Phi3ForCausalLM
from executor.sharding import ShardPlan
from executor.weights import load_weights, parse_dtype

MODEL_CLASSES = {"llama": LlamaForCausalLM, "gemma2": GemmaForCausalLM, "gemma3": GemmaForCausalLM,
                 "phi3": Phi3ForCausalLM, "mixtral": MixtralForCausalLM}


def load_model(model_dir: str, dtype: str | torch.dtype = "float32",
               on_built: Callable[[nn.Module], None] | None = None,
               plan: ShardPlan | None = None) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Read config.json and the safetensors of `model_dir`, building the model one layer at a
    time (on_built: called with each decoder layer once built, then with the model; see
    LlamaForCausalLM); raises ModelLoadError naming the file and what was expected when
    something is missing, corrupt or the wrong shape. With `plan`, the model is one
    tensor-parallel rank's shard (executor.sharding; model.config is the shard's); the
    config returned is the whole model's."""
    config = ModelConfig.from_dir(model_dir)
    weights = load_weights(model_dir, config, parse_dtype(dtype))
    if plan is not None:
        model = MODEL_CLASSES[config.family](plan.config(config), plan.weights(weights, config), on_built)
        return model.eval(), config
    model = MODEL_CLASSES[config.family](config, weights, on_built).eval()
    return model, config
