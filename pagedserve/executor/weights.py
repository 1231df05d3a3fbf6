"""Reading and checking a Hugging Face checkpoint's safetensors.

load_weights checks every tensor's presence and shape up front and returns CheckpointWeights:
a mapping that reads a tensor when it is looked up, each time into memory of its own (not a
view of the file's mapping), and keeps nothing. A model built from it one layer at a time
therefore holds at most the layers built so far plus the one being built, and what it frees
(the q/k/v parts of a fused QKV weight, a dense weight once prepacked) leaves the process.
"""
from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator, Mapping

import torch
from safetensors import SafetensorError, safe_open

from pagedserve.executor.errors import ModelLoadError
from pagedserve.executor.model_config import ModelConfig
from pagedserve.executor.models import registry

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; supported: {', '.join(DTYPES)}")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; supported: {', '.join(DTYPES)}")
    return DTYPES[dtype]


def expected_weights(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the checkpoint must hold, by Hugging Face name, with its shape: as the
    architecture's family declares them (pagedserve/executor/models/registry.py)."""
    return registry.for_architecture(config.architecture).weights(config)


def safetensors_files(model_dir: str) -> list[str]:
    """The checkpoint's files: those of model.safetensors.index.json, else every *.safetensors."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise ModelLoadError(f"{index}: not a readable index with a weight_map ({e!r})") from e
        files = [os.path.join(model_dir, name) for name in sorted(set(weight_map.values()))]
        for path in files:
            if not os.path.exists(path):
                raise ModelLoadError(f"{path}: not found; it is listed in {index}")
        return files
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ModelLoadError(
            f"{model_dir}: no safetensors weights; expected model.safetensors "
            "or model.safetensors.index.json with its shards"
        )
    return files


class CheckpointWeights(Mapping):
    """name -> tensor in `dtype`, read from its file on each lookup (see the module docstring);
    a file that fails to read raises ModelLoadError naming it and the tensor."""

    def __init__(self, where: dict[str, str], dtype: torch.dtype):
        self._where = where  # tensor name -> the file holding it
        self.dtype = dtype

    def __getitem__(self, name: str) -> torch.Tensor:
        path = self._where[name]
        try:
            with safe_open(path, framework="pt") as f:
                t = f.get_tensor(name)
                # a view of the file's mapping would keep the whole mapping, and every page of it
                # read so far, resident for as long as the tensor lives: copy out of it
                return t.clone() if t.dtype == self.dtype else t.to(self.dtype)
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"{path}: tensor {name} could not be read ({e})") from e

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def load_weights(model_dir: str, config: ModelConfig, dtype: torch.dtype) -> CheckpointWeights:
    """Every expected tensor, after checking its shape, read on lookup (CheckpointWeights).

    Tensors the model does not use (e.g. a tied lm_head, rotary buffers) are skipped.
    Raises ModelLoadError naming the file and the tensor for a corrupt file, a missing
    tensor or a wrong shape.
    """
    expected = expected_weights(config)
    where: dict[str, str] = {}
    files = safetensors_files(model_dir)
    for path in files:
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    if name not in expected:
                        continue
                    shape = tuple(f.get_slice(name).get_shape())
                    if shape != expected[name]:
                        raise ModelLoadError(
                            f"{path}: tensor {name} has shape {list(shape)}, expected "
                            f"{list(expected[name])} for this config.json"
                        )
                    where[name] = path
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"{path}: not a readable safetensors file ({e})") from e
    missing = [name for name in expected if name not in where]
    if missing:
        source = files[0] if len(files) == 1 else f"{len(files)} files in {model_dir}"
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ModelLoadError(
            f"{source}: missing tensor {missing[0]} (expected shape {list(expected[missing[0]])}){more}"
        )
    return CheckpointWeights(where, dtype)
