"""Build the model from a Hugging Face-style directory, with a progress bar on a terminal."""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from tqdm.auto import tqdm

from pagedserve.executor.errors import ModelLoadError
from pagedserve.executor.model_config import ModelConfig
from pagedserve.executor.models import registry
from pagedserve.executor.sharding import ShardPlan
from pagedserve.executor.weights import load_weights, parse_dtype


def load_model(model_dir: str, dtype: str | torch.dtype = "float32",
               on_built: Callable[[nn.Module], None] | None = None,
               plan: ShardPlan | None = None, progress: bool | None = None, impl: str = "native",
               ) -> tuple[nn.Module, ModelConfig]:
    """Read config.json and the safetensors of `model_dir`, building the model one layer at a
    time (on_built: called with each decoder layer once built, then with the model; see
    pagedserve.executor.models.decoder.DecoderForCausalLM), the class its family declares
    (pagedserve.executor.models.registry); raises ModelLoadError naming the file and what was expected when
    something is missing, corrupt or the wrong shape. With `plan`, the model is one
    tensor-parallel rank's shard (pagedserve.executor.sharding; model.config is the shard's); the
    config returned is the whole model's. `progress`: a bar over the layers as they load
    (None: on a terminal only). `impl`: --model-impl (ModelConfig.from_dir); a transformers
    model is pagedserve.executor.models.transformers_backend's (on_built: called with the model)."""
    config = ModelConfig.from_dir(model_dir, impl)
    if config.impl == "transformers":
        from pagedserve.executor.models.transformers_backend import TransformersModel

        if plan is not None:
            raise ModelLoadError("--tensor-parallel-size > 1 splits native models only: use --model-impl native")
        return TransformersModel.load(model_dir, config, parse_dtype(dtype), on_built), config
    weights = load_weights(model_dir, config, parse_dtype(dtype))
    bar = tqdm(total=config.num_layers + 1, desc="loading weights",
               unit="part", disable=None if progress is None else not progress)

    def built(module: nn.Module) -> None:  # each layer, then the whole model
        bar.update()
        if on_built is not None:
            on_built(module)

    model_class = registry.for_architecture(config.architecture).model_class
    with bar:
        if plan is not None:
            model = model_class(plan.config(config), plan.weights(weights, config), built)
        else:
            model = model_class(config, weights, built)
    return model.eval(), config
