"""Build the model from a Hugging Face-style directory."""
from __future__ import annotations

import torch

from executor.model_config import ModelConfig
from executor.models.llama import LlamaForCausalLM
from executor.weights import load_weights, parse_dtype


def load_model(model_dir: str, dtype: str | torch.dtype = "float32") -> tuple[LlamaForCausalLM, ModelConfig]:
    """Read config.json and the safetensors of `model_dir`; raises ModelLoadError naming the
    file and what was expected when something is missing, corrupt or the wrong shape."""
    config = ModelConfig.from_dir(model_dir)
    weights = load_weights(model_dir, config, parse_dtype(dtype))
    model = LlamaForCausalLM(config, weights).eval()
    return model, config
