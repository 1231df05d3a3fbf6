"""Convert a GGUF file into a cached Hugging Face-style model directory.

The directory holds config.json, generation_config.json, model.safetensors (float32,
dequantized) and the tokenizer files (with the chat template). It lives under
`models/` of pagedserve's cache (pagedserve/wire/cache_dir.py: `$PAGEDSERVE_CACHE/models`, default
`~/.cache/pagedserve/models`) in `<file stem>-<key>`, where the
key is a SHA-256 of the file's whole content and the converter version (never its name, size
or modification time: two different files must not share a cache), and it is written to a
temporary directory renamed into place, so a crash never leaves a half-written cache.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm

from pagedserve.executor.errors import ModelLoadError
from pagedserve.executor.models import registry
from pagedserve.executor.models.family import Gguf
from pagedserve.wire.cache_dir import cache_dir

CONVERTER_VERSION = 1
# the tensor names of the default model's architecture (llama), which its tests read
GLOBAL_NAMES = registry.for_gguf("llama").gguf.global_names
LAYER_NAMES = registry.for_gguf("llama").gguf.layer_names


def cache_root() -> str:
    return cache_dir("models")


def content_key(gguf_path: str) -> str:
    """SHA-256 of the converter version and every byte of the file (about 0.2 s per 100 MB)."""
    h = hashlib.sha256(f"pagedserve-gguf-converter:{CONVERTER_VERSION}\n".encode())
    with open(gguf_path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def cache_dir_for(gguf_path: str) -> str:
    key = content_key(gguf_path)
    stem = os.path.splitext(os.path.basename(gguf_path))[0]
    return os.path.join(cache_root(), f"{stem}-{key[:12]}")


def ensure_converted(gguf_path: str, progress: bool = True) -> str:
    """Return the cached model directory for `gguf_path`, converting it first if needed."""
    if not os.path.isfile(gguf_path):
        raise ModelLoadError(f"{gguf_path}: GGUF file not found")
    target = cache_dir_for(gguf_path)
    if os.path.exists(os.path.join(target, "config.json")):
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(target))
    try:
        convert(gguf_path, tmp, progress=progress)
        try:
            os.rename(tmp, target)
        except OSError:
            if not os.path.exists(os.path.join(target, "config.json")):
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process finished first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's reordering of q/k rows (interleaved rotary pairs -> two halves per head)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def convert(gguf_path: str, out_dir: str, progress: bool = True) -> None:
    """Write the HF-style directory for `gguf_path` into the existing `out_dir`."""
    import gguf
    from gguf.quants import dequantize

    try:
        reader = gguf.GGUFReader(gguf_path)
    except Exception as e:
        raise ModelLoadError(f"{gguf_path}: not a readable GGUF file ({e})") from e
    arch = _field(reader, "general.architecture")
    family = registry.for_gguf(arch)
    if family is None:
        raise ModelLoadError(
            f"{gguf_path}: GGUF architecture {arch!r} is not supported; supported: "
            + ", ".join(registry.gguf_architectures())
        )
    config = _hf_config(reader, arch, family.gguf, gguf_path)
    n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]

    tensors: dict[str, torch.Tensor] = {}
    for t in tqdm(reader.tensors, desc=f"converting {os.path.basename(gguf_path)}",
                  unit="tensor", disable=not progress):
        name = _hf_name(t.name, family.gguf, gguf_path)
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        w = w.reshape([int(d) for d in reversed(t.shape)])
        if arch in family.gguf.permuted and name.endswith("q_proj.weight"):
            w = unpermute_rotary(w, n_head)
        elif arch in family.gguf.permuted and name.endswith("k_proj.weight"):
            w = unpermute_rotary(w, n_kv)
        w = np.ascontiguousarray(w)
        tensors[name] = torch.from_numpy(w if w.flags.writeable else w.copy())
    config["tie_word_embeddings"] = "lm_head.weight" not in tensors
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})

    gen = {"bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id")}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({k: v for k, v in gen.items() if v is not None}, f, indent=2)
    _save_tokenizer(gguf_path, out_dir)


def _hf_name(name: str, gguf: Gguf, gguf_path: str) -> str:
    if name in gguf.global_names:
        return gguf.global_names[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in gguf.layer_names:
        return f"model.layers.{parts[1]}.{gguf.layer_names[parts[2]]}"
    raise ModelLoadError(f"{gguf_path}: tensor {name!r} has no Hugging Face equivalent here")


def _hf_config(reader, arch: str, gguf: Gguf, gguf_path: str) -> dict:
    """config.json: the family's fields from the metadata (Gguf.config), then the vocabulary's."""
    def get(key, default=None):
        value = _field(reader, f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{gguf_path}: missing metadata {arch}.{key}")
        return value

    try:
        fields = gguf.config(get)
    except ValueError as e:
        raise ModelLoadError(f"{gguf_path}: {e}") from e
    vocab = _field(reader, f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    return {
        "architectures": [gguf.architectures[arch]],
        "model_type": arch,
        **fields,
        "vocab_size": int(vocab),
        "torch_dtype": "float32",
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }


def _save_tokenizer(gguf_path: str, out_dir: str) -> None:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(
            os.path.dirname(os.path.abspath(gguf_path)), gguf_file=os.path.basename(gguf_path)
        )
    except Exception as e:
        raise ModelLoadError(f"{gguf_path}: could not build a tokenizer from it ({e})") from e
    tok.save_pretrained(out_dir)
