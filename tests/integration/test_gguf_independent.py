"""The default model's GGUF conversion checked against readers that are not ours.

1. Every tensor: the raw blocks read with the `gguf` package's GGUFReader and dequantized
   here by an independent numpy implementation of the GGUF block formats (F32, Q8_0, Q4_1),
   compared with the converted model.safetensors (q/k rows put back in llama.cpp's order).
2. transformers' own GGUF loader (`from_pretrained(..., gguf_file=...)`, which needs
   accelerate): its weights equal the converted ones, and greedy continuations of the held
   prompts from our engine on the converted directory equal transformers' on the GGUF
   (checked by one forward pass per prompt: tests/support/hf_reference.py).

The file's metadata is parsed once for the module (gguf-py's reader takes ~3 s per parse;
transformers' loader would parse it twice more).
"""
import contextlib
import functools
import importlib.util
import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from pagedserve.executor.model_source import default_gguf_path
from pagedserve.executor.gguf_convert import GLOBAL_NAMES, LAYER_NAMES
from tests.support.hf_reference import hf_greedy
from tests.unit.executor.test_model_gguf import llama_cpp_permute

QK = 32  # weights per block in Q8_0 and Q4_1


def dequantize_independent(raw: np.ndarray, kind: str, n_elements: int) -> np.ndarray:
    """GGUF block formats from their byte layout (ggml-common.h), not via gguf.quants."""
    data = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    if kind == "F32":
        return data.view(np.float32)[:n_elements].copy()
    if kind == "Q8_0":  # block: f16 scale d, 32 x int8 q; w = d * q
        blocks = data.reshape(-1, 2 + QK)
        d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
        q = blocks[:, 2:].copy().view(np.int8).astype(np.float32)
        return (d * q).reshape(-1)[:n_elements]
    if kind == "Q4_1":  # block: f16 d, f16 m, 16 bytes: low nibbles are weights 0..15, high 16..31
        blocks = data.reshape(-1, 4 + QK // 2)
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
        m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        qs = blocks[:, 4:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)
        return (d * q + m).reshape(-1)[:n_elements]
    raise AssertionError(f"no independent dequantizer for {kind}")


def hf_name(name: str) -> str:
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    _, layer, rest = name.split(".", 2)
    return f"model.layers.{layer}.{LAYER_NAMES[rest]}"


@pytest.fixture(scope="module")
def reader():
    """gguf-py's reader of the default GGUF file (read-only: a memory map and its parse)."""
    import gguf

    return gguf.GGUFReader(default_gguf_path())


@pytest.fixture
def parsed_once(reader):
    """A context in which transformers' GGUF loader, which parses the file again for the
    config and again for the weights and builds gguf-py's tensor-name table anew for each
    of the model's ~400 modules (~5 s), gets the module's reader for this file and one table
    per (architecture, layers). Both are pure reads of the same file: no value changes."""
    import gguf

    new_reader, name_map = gguf.GGUFReader, functools.cache(gguf.get_tensor_name_map)

    def reader_of(path, *args, **kwargs):
        if not args and not kwargs and os.path.samefile(path, default_gguf_path()):
            return reader
        return new_reader(path, *args, **kwargs)

    @contextlib.contextmanager
    def parsed_once():
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(gguf, "GGUFReader", reader_of)
            mp.setattr(gguf, "get_tensor_name_map", name_map)
            yield
    return parsed_once


def test_tensors_match_an_independent_dequantization(default_model_dir, reader):
    converted = load_file(os.path.join(default_model_dir, "model.safetensors"))
    cfg = json.load(open(os.path.join(default_model_dir, "config.json")))
    kinds = set()
    assert len(reader.tensors) == len(converted)
    for t in reader.tensors:
        shape = [int(d) for d in reversed(t.shape)]
        kinds.add(t.tensor_type.name)
        mine = dequantize_independent(t.data, t.tensor_type.name, int(np.prod(shape))).reshape(shape)
        theirs = converted[hf_name(t.name)].numpy()
        if t.name.endswith("attn_q.weight"):
            theirs = llama_cpp_permute(theirs, cfg["num_attention_heads"])
        elif t.name.endswith("attn_k.weight"):
            theirs = llama_cpp_permute(theirs, cfg["num_key_value_heads"])
        assert theirs.shape == mine.shape, t.name
        np.testing.assert_array_equal(theirs, mine, err_msg=t.name)
    assert kinds == {"F32", "Q8_0", "Q4_1"}


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of",
           "Once upon a time, in a small village by the sea,"]
NEW_TOKENS = 24


@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None,
                    reason="transformers refuses to load a GGUF file without accelerate "
                           "('accelerate is required when loading a GGUF file'); pip install accelerate")
def test_greedy_matches_transformers_gguf_loader(default_model_dir, parsed_once):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedserve.engine import LLMEngine
    from pagedserve.wire.protocol import SamplingParams

    path = default_gguf_path()
    with parsed_once():
        hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                  dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    ours = load_file(os.path.join(default_model_dir, "model.safetensors"))
    theirs = hf.state_dict()
    for name, w in ours.items():
        assert torch.equal(theirs[name].float(), w), name
    prompt_ids = [tok.encode(p, add_special_tokens=False) for p in PROMPTS]
    engine = LLMEngine(model=path, block_size=16, kv_tokens=2048)  # the .gguf path: our converted cache
    sampling = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    got = [o.completions[0].token_ids for o in engine.generate(prompt_ids, sampling)]
    assert got == hf_greedy(hf, prompt_ids, got, NEW_TOKENS)
