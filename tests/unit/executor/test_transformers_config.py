"""The Transformers backend's config reading (pagedserve/executor/transformers_config.py): the KV
geometry of any causal LM read from its Hugging Face config, --model-impl auto's choice, and
what it refuses, by field."""
import json

import pytest

from pagedserve.executor.errors import ModelLoadError
from pagedserve.executor.model_config import ModelConfig
from pagedserve.executor.model_loader import load_model


def save_config(path, config_cls: str, **fields) -> str:
    import transformers

    getattr(transformers, config_cls)(**fields).save_pretrained(str(path))
    return str(path)


def edit(path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_geometry_under_each_models_names(tmp_path):
    gpt2 = ModelConfig.from_dir(save_config(tmp_path / "gpt2", "GPT2Config", n_embd=96, n_layer=3, n_head=6,
                                            n_positions=512, vocab_size=300), "auto")
    assert gpt2.impl == gpt2.family == "transformers" and gpt2.architecture == "GPT2LMHeadModel"
    assert (gpt2.num_layers, gpt2.num_heads, gpt2.num_kv_heads, gpt2.head_dim) == (3, 6, 6, 16)
    assert (gpt2.vocab_size, gpt2.max_model_len, gpt2.kv_window) == (300, 512, None)
    mqa = ModelConfig.from_dir(save_config(tmp_path / "bigcode", "GPTBigCodeConfig", n_embd=64, n_head=4,
                                           multi_query=True), "transformers")
    assert (mqa.num_heads, mqa.num_kv_heads, mqa.head_dim) == (4, 1, 16)
    gqa = ModelConfig.from_dir(save_config(tmp_path / "olmo2", "Olmo2Config", hidden_size=64, num_attention_heads=4,
                                           num_key_value_heads=2, eos_token_id=7), "transformers")
    assert (gqa.num_kv_heads, gqa.head_dim, gqa.eos_token_ids) == (2, 16, [7])


def test_auto_is_native_where_there_is_a_family(tmp_path):
    llama = save_config(tmp_path, "LlamaConfig", hidden_size=64, num_attention_heads=4, intermediate_size=96,
                        architectures=["LlamaForCausalLM"])
    assert ModelConfig.from_dir(llama, "auto").impl == "native"
    assert ModelConfig.from_dir(llama).impl == "native"
    assert ModelConfig.from_dir(llama, "transformers").family == "transformers"
    with pytest.raises(ModelLoadError, match="--model-impl 'fast'"):
        ModelConfig.from_dir(llama, "fast")


@pytest.mark.parametrize("config_cls, fields, edits, why", [
    ("BartConfig", {}, {"architectures": ["BartForCausalLM"]}, "is_encoder_decoder=true"),
    ("T5Config", {}, {"architectures": ["T5ForConditionalGeneration"]}, "model_type 't5' has no causal"),
    ("DeepseekV3Config", {"num_hidden_layers": 2}, {"architectures": ["DeepseekV3ForCausalLM"]},
     "kv_lora_rank=512: multi-head latent attention"),
    ("MambaConfig", {"num_hidden_layers": 2}, {"architectures": ["MambaForCausalLM"]},
     "layer_types entry 'linear_attention'"),
    ("Qwen3NextConfig", {"num_hidden_layers": 4}, {"architectures": ["Qwen3NextForCausalLM"]},
     "layer_types entry 'linear_attention'"),
    ("FalconConfig", {"alibi": True}, {"architectures": ["FalconForCausalLM"]}, "alibi=True: ALiBi"),
    ("GPT2Config", {}, {"auto_map": {"AutoModelForCausalLM": "mine.Model"}}, r"auto_map: .* \(trust_remote_code\)"),
    ("GPT2Config", {}, {"quantization_config": {"quant_method": "gptq"}}, "quant_method 'gptq'"),
    ("GPT2Config", {}, {"architectures": ["FalconForCausalLM"]},
     "names 'FalconForCausalLM', but model_type 'gpt2' is transformers' GPT2LMHeadModel"),
])
def test_refused_by_field(tmp_path, config_cls, fields, edits, why):
    save_config(tmp_path, config_cls, **fields)
    edit(tmp_path, **edits)
    with pytest.raises(ModelLoadError, match=why) as e:
        ModelConfig.from_dir(str(tmp_path), "auto")
    assert str(tmp_path / "config.json") in str(e.value)


def test_attention_outside_the_interface_refused(tmp_path):
    save_config(tmp_path, "FalconConfig", hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                architectures=["FalconForCausalLM"])
    with pytest.raises(ModelLoadError, match="_supports_attention_backend is false"):
        load_model(str(tmp_path), impl="transformers")
