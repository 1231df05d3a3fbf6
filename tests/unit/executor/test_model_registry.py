"""Model families (pagedserve/executor/models/registry.py): every registered family declares
every part, each matching what transformers writes for its architectures; and a family that
exists only as a registry entry (one made here) loads, computes and splits like the rest."""
import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from pagedserve.executor import sharding
from pagedserve.executor.errors import ModelLoadError
from pagedserve.executor.model_config import ModelConfig
from pagedserve.executor.model_loader import load_model
from pagedserve.executor.model_runner import ModelRunner
from pagedserve.executor.models import registry
from pagedserve.executor.models.decoder import SHARDING, DecoderForCausalLM, DecoderLayer
from pagedserve.executor.models.family import CUTS, Family
from pagedserve.executor.weights import expected_weights, load_weights
from tests.support.tiny_models import TINY_ARCHS, make_tiny_model
from tests.unit.executor.test_model_logits import check_against_hf


def leaf(name: str) -> str:
    return name.split(".")[-2]


def saved_shapes(path) -> dict[str, tuple[int, ...]]:
    with safe_open(os.path.join(str(path), "model.safetensors"), framework="pt") as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}


def test_every_cut_a_family_may_name_is_implemented():
    assert set(sharding.CUTTERS) == set(CUTS)


@pytest.mark.parametrize("family", registry.families(), ids=lambda f: f.name)
def test_every_family_declares_every_part(family, tmp_path):
    """Each architecture's tiny checkpoint (tests/support/tiny_models.py) reads as this family:
    its weights are exactly the tensors transformers saved, each with a cut, every refused
    field is refused by name, and the GGUF names land on tensors the family declares."""
    assert registry.for_architecture(family.architectures[0]) is family
    assert callable(family.model_class.weight_shapes)
    tiny = {name: arch for name, (_, arch, _) in TINY_ARCHS.items() if arch in family.architectures}
    assert set(tiny.values()) == set(family.architectures), "add a tiny config of each architecture to TINY_ARCHS"
    declared: set[str] = set()
    for name, arch in sorted(tiny.items()):
        make_tiny_model(tmp_path / name, name)
        cfg = json.loads((tmp_path / name / "config.json").read_text())
        config = ModelConfig.from_dict(cfg)
        assert config.family == family.name
        weights = family.weights(config)
        assert weights == saved_shapes(tmp_path / name), name
        assert {leaf(w) for w in weights} <= set(family.sharding), f"{name}: a tensor without a cut"
        assert set(family.sharding.values()) <= set(CUTS)
        declared |= {w.replace("model.layers.0.", "") for w in weights}
        for key in family.refused:
            with pytest.raises(ValueError, match=key):
                ModelConfig.from_dict({**cfg, key: True})
        family.validate(config)
    if family.gguf is not None:
        assert set(family.gguf.architectures.values()) <= set(family.architectures)
        assert set(family.gguf.global_names.values()) <= declared
        assert set(family.gguf.layer_names.values()) <= declared
        assert all(a in family.gguf.architectures for a in family.gguf.permuted)
        assert all(registry.for_gguf(a) is family for a in family.gguf.architectures)


class FusedLayer(DecoderLayer):
    """q, k and v in one tensor under this family's own name."""

    @staticmethod
    def qkv_shapes(c, a: str) -> dict[str, tuple[int, ...]]:
        return {a + "wqkv.weight": (c.q_size + 2 * c.kv_size, c.hidden_size)}

    def qkv_weight(self, w, a: str):
        return w[a + "wqkv.weight"]


class TinyForCausalLM(DecoderForCausalLM):
    layer_class = FusedLayer


def tiny_config(arch: str, cfg: dict) -> dict:
    """config.json keys of this family's own naming."""
    return {"vocab_size": cfg["n_vocab"], "hidden_size": cfg["n_embd"], "num_layers": cfg["n_layer"],
            "num_heads": cfg["n_head"], "num_kv_heads": cfg["n_head_kv"], "head_dim": cfg["n_embd"] // cfg["n_head"],
            "intermediate_size": cfg["n_inner"], "rms_norm_eps": cfg["eps"], "rope_theta": cfg["rope_base"],
            "max_position_embeddings": cfg["n_ctx"]}


TINY = Family(name="tiny", architectures=("TinyForCausalLM",), model_class=TinyForCausalLM, config=tiny_config,
              weights=TinyForCausalLM.weight_shapes, sharding={**SHARDING, "wqkv": "qkv_rows"},
              refused=("parallel_residual",))


@pytest.fixture
def tiny_family():
    registry.register(TINY)
    yield TINY
    registry.unregister(TINY.name)


def test_a_registry_entry_is_all_it_takes(tmp_path, tiny_family):
    """Mistral's tiny checkpoint rewritten in the tiny family's names loads through the
    registry alone, computes transformers' Mistral logits, and splits its fused tensor."""
    hf = make_tiny_model(tmp_path / "mistral", "mistral")
    ref = ModelConfig.from_dir(str(tmp_path / "mistral"))
    path = tmp_path / "tiny"
    path.mkdir()
    cfg = {"architectures": ["TinyForCausalLM"], "n_vocab": ref.vocab_size, "n_embd": ref.hidden_size,
           "n_layer": ref.num_layers, "n_head": ref.num_heads, "n_head_kv": ref.num_kv_heads,
           "n_inner": ref.intermediate_size, "eps": ref.rms_norm_eps, "rope_base": ref.rope_theta,
           "n_ctx": ref.max_position_embeddings}
    (path / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(tmp_path / "mistral" / "model.safetensors"))
    for n in range(ref.num_layers):
        a = f"model.layers.{n}.self_attn."
        tensors[a + "wqkv.weight"] = torch.cat([tensors.pop(a + f"{p}_proj.weight") for p in "qkv"])
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})

    config = ModelConfig.from_dir(str(path), "auto")
    assert (config.impl, config.family, config.num_kv_heads) == ("native", "tiny", ref.num_kv_heads)
    assert expected_weights(config) == saved_shapes(path)
    model, _ = load_model(str(path))
    assert type(model) is TinyForCausalLM
    pool = torch.zeros(48, config.num_layers, 2, 4, config.num_kv_heads, config.head_dim)
    g = torch.Generator().manual_seed(3)
    prompts = {k: torch.randint(0, config.vocab_size, (n,), generator=g).tolist()
               for k, n in (("a", 30), ("b", 9), ("c", 23))}
    check_against_hf(hf, ModelRunner(model, config, pool), prompts, 4, 48)

    plan = sharding.ShardPlan.of(config, 2, 1)
    ours = plan.weights(load_weights(str(path), config, torch.float32), config)
    theirs = plan.weights(load_weights(str(tmp_path / "mistral"), ref, torch.float32), ref)
    a = "model.layers.1.self_attn."
    assert torch.equal(ours[a + "wqkv.weight"], torch.cat([theirs[a + f"{p}_proj.weight"] for p in "qkv"]))

    (path / "config.json").write_text(json.dumps({**cfg, "parallel_residual": True}))
    with pytest.raises(ModelLoadError, match="parallel_residual"):
        ModelConfig.from_dir(str(path))


def test_a_family_is_registered_once_and_whole():
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        registry.register(Family(name="other", architectures=("LlamaForCausalLM",), model_class=TinyForCausalLM,
                                 config=tiny_config, weights=TinyForCausalLM.weight_shapes, sharding=SHARDING))
    with pytest.raises(ValueError, match="unknown cuts"):
        Family(name="other", architectures=("OtherForCausalLM",), model_class=TinyForCausalLM, config=tiny_config,
               weights=TinyForCausalLM.weight_shapes, sharding={**SHARDING, "wqkv": "by_magic"})
    with pytest.raises(TypeError, match="weights"):
        Family(name="other", architectures=("OtherForCausalLM",), model_class=TinyForCausalLM, config=tiny_config,
               weights=None, sharding=SHARDING)
    assert registry.for_architecture("OtherForCausalLM") is None
