"""Model directories: config.json parsing and the errors for broken checkpoints."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.support.tiny_models import make_tiny_model
from pagedserve.executor.errors import ModelLoadError
from pagedserve.executor.model_config import ModelConfig
from pagedserve.executor.model_loader import load_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    make_tiny_model(path, "llama3")
    return path


@pytest.fixture
def broken(tiny_dir, tmp_path):
    """A private copy of the tiny model to damage."""
    path = tmp_path / "model"
    shutil.copytree(tiny_dir, path)
    return path


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_config_fields(tiny_dir):
    c = ModelConfig.from_dir(str(tiny_dir))
    assert c.architecture == "LlamaForCausalLM"
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (64, 2, 4, 2, 16)
    assert c.rope_theta == 500000.0
    assert c.rope_scaling.rope_type == "llama3" and c.rope_scaling.factor == 8.0
    assert c.rope_scaling.original_max_position_embeddings == 16
    assert not c.qkv_bias and not c.qk_norm and not c.tie_word_embeddings


def test_config_legacy_keys_and_flags():
    c = ModelConfig.from_dict({
        "architectures": ["Qwen2ForCausalLM"], "vocab_size": 10, "hidden_size": 32,
        "num_hidden_layers": 1, "num_attention_heads": 4, "intermediate_size": 8,
        "rope_theta": 1e6, "rope_scaling": None, "eos_token_id": [5, 6],
        "sliding_window": 128, "use_sliding_window": False,
    })
    assert c.num_kv_heads == 4 and c.head_dim == 8 and c.rope_theta == 1e6
    assert c.qkv_bias and not c.o_bias and c.eos_token_ids == [5, 6] and c.sliding_window is None
    q3 = ModelConfig.from_dict({
        "architectures": ["Qwen3ForCausalLM"], "vocab_size": 10, "hidden_size": 32,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "intermediate_size": 8,
        "rope_scaling": {"type": "llama3", "factor": 2, "low_freq_factor": 1,
                         "high_freq_factor": 4, "original_max_position_embeddings": 64},
    })
    assert q3.qk_norm and not q3.qkv_bias and q3.head_dim == 16 and q3.q_size == 64
    assert q3.rope_scaling.rope_type == "llama3"


def test_generation_config_adds_eos(broken):
    (broken / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert ModelConfig.from_dir(str(broken)).eos_token_ids == [2, 7]


def test_unsupported_architecture(broken):
    edit_config(broken, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelLoadError) as e:
        load_model(str(broken))
    msg = str(e.value)
    assert str(broken / "config.json") in msg and "GPT2LMHeadModel" in msg
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                 "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM"):
        assert arch in msg


def test_missing_config(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(str(tmp_path))


def test_missing_safetensors(broken):
    (broken / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError) as e:
        load_model(str(broken))
    assert str(broken) in str(e.value) and "model.safetensors" in str(e.value)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_safetensors(broken, damage):
    path = broken / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(b"\x07not a safetensors file" * 10 if damage == "garbage" else data[: len(data) // 2])
    with pytest.raises(ModelLoadError) as e:
        load_model(str(broken))
    assert str(path) in str(e.value) and "safetensors" in str(e.value)


def test_wrong_shape(broken):
    edit_config(broken, intermediate_size=100)
    with pytest.raises(ModelLoadError) as e:
        load_model(str(broken))
    msg = str(e.value)
    assert str(broken / "model.safetensors") in msg
    assert "mlp." in msg and ("[100, 64]" in msg or "[64, 100]" in msg)


def test_missing_tensor(broken):
    path = broken / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError) as e:
        load_model(str(broken))
    assert str(path) in str(e.value)
    assert "model.layers.1.self_attn.k_proj.weight" in str(e.value) and "[32, 64]" in str(e.value)


def test_sharded_checkpoint_loads(tmp_path):
    hf = make_tiny_model(tmp_path / "whole", "qwen2")
    hf.save_pretrained(str(tmp_path / "sharded"), max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    whole, _ = load_model(str(tmp_path / "whole"))
    sharded, _ = load_model(str(tmp_path / "sharded"))
    for (name, a), (_, b) in zip(whole.named_parameters(), sharded.named_parameters()):
        assert torch.equal(a, b), name


def test_sharded_checkpoint_missing_shard(tmp_path):
    hf = make_tiny_model(tmp_path / "whole", "mistral")
    hf.save_pretrained(str(tmp_path / "sharded"), max_shard_size="40KB")
    shard = sorted((tmp_path / "sharded").glob("*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ModelLoadError) as e:
        load_model(str(tmp_path / "sharded"))
    assert str(shard) in str(e.value) and "model.safetensors.index.json" in str(e.value)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_dtypes(tiny_dir, dtype):
    model, _ = load_model(str(tiny_dir), dtype=dtype)
    assert all(p.dtype == getattr(torch, dtype) for p in model.parameters())


def test_unknown_dtype(tiny_dir):
    with pytest.raises(ValueError, match="float32"):
        load_model(str(tiny_dir), dtype="int8")


# Each family's config with one field that changes the computation and is not implemented.
UNIMPLEMENTED = {
    "llama3": ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 5e5}}, "yarn"),
    "mistral": ({"hidden_act": "relu"}, "hidden_act"),
    "qwen2": ({"quantization_config": {"quant_method": "awq", "bits": 4}}, "quantization_config"),
    "qwen3": ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}}, "dynamic"),
    "gemma2": ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    "gemma3": ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 8.0, "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}, "yarn"),
    "phi3": ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    "mixtral": ({"hidden_act": "gelu"}, "hidden_act"),
    "qwen2_swa": ({"layer_types": ["chunked_attention", "full_attention"]}, "chunked_attention"),
    "llama_bias": ({"mlp_bias": True}, "mlp_bias"),
}


@pytest.mark.parametrize("arch", sorted(UNIMPLEMENTED))
def test_unimplemented_config_field_fails_loading(tmp_path, arch):
    make_tiny_model(tmp_path, arch, tie=arch.startswith("gemma"))
    load_model(str(tmp_path))  # as saved: loads
    changes, name = UNIMPLEMENTED[arch]
    edit_config(tmp_path, **changes)
    with pytest.raises(ModelLoadError) as e:
        load_model(str(tmp_path))
    assert name in str(e.value) and str(tmp_path / "config.json") in str(e.value)


def test_mixtral_unimplemented_field(tmp_path):
    make_tiny_model(tmp_path, "mixtral")
    edit_config(tmp_path, rope_parameters={"rope_type": "longrope", "short_factor": [1.0] * 8,
                                           "long_factor": [1.0] * 8, "partial_rotary_factor": 0.25})
    with pytest.raises(ModelLoadError, match="partial_rotary_factor"):
        load_model(str(tmp_path))


def test_sliding_window_layers_as_transformers():
    base = {"vocab_size": 10, "hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
            "intermediate_size": 8, "sliding_window": 16}
    mistral = ModelConfig.from_dict({**base, "architectures": ["MistralForCausalLM"]})
    assert [mistral.layer_window(n) for n in range(4)] == [16] * 4 and mistral.kv_window == 16
    qwen2 = ModelConfig.from_dict({**base, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True,
                                   "max_window_layers": 2})
    assert [qwen2.layer_window(n) for n in range(4)] == [None, None, 16, 16] and qwen2.kv_window is None
    gemma2 = ModelConfig.from_dict({**base, "architectures": ["Gemma2ForCausalLM"]})
    assert [gemma2.layer_window(n) for n in range(4)] == [16, None, 16, None]
    llama = ModelConfig.from_dict({**base, "architectures": ["LlamaForCausalLM"]})
    assert llama.sliding_window is None  # transformers' Llama has no sliding window
