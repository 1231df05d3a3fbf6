"""The Transformers backend (--model-impl transformers): tiny random models of architectures
with no native file, through the offline engine, greedy-equal to transformers' own generate
(prompts longer than a block, a shared prefix, batched and again from the prefix cache,
and under preemption); a native family served both ways gives the same tokens; what the
backend cannot serve is refused at load by name."""
import json

import pytest
import torch

from pagedserve.cli import main
from pagedserve.engine import LLMEngine
from pagedserve.executor.errors import ModelLoadError
from pagedserve.executor.models import transformers_backend
from pagedserve.wire.protocol import SamplingParams
from tests.support.tiny_models import (
    hf_greedy_past_eos,
    make_tiny_model,
    save_tiny_tokenizer,
)
from tests.unit.gateway.test_preemption import assert_clean

TINY = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "vocab_size": 300, "max_position_embeddings": 256, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0}
GPT = {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256}  # GPT-2-style names
# architecture -> (config class, model class, settings): none has a native file
ARCHS = {
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {"rotary_pct": 0.5}),  # partial rotary
    "opt": ("OPTConfig", "OPTForCausalLM", {"ffn_dim": 96, "word_embed_proj_dim": 64}),  # learned positions
    "gptj": ("GPTJConfig", "GPTJForCausalLM", {**GPT, "rotary_dim": 8}),  # interleaved rotary
    "cohere": ("CohereConfig", "CohereForCausalLM", {"num_key_value_heads": 2, "logit_scale": 0.5,
                                                     "use_qk_norm": True}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {"num_key_value_heads": 2}),  # q/k norms
    "granite": ("GraniteConfig", "GraniteForCausalLM", {
        "num_key_value_heads": 2, "embedding_multiplier": 2.0, "residual_multiplier": 0.5,
        "attention_multiplier": 0.3, "logits_scaling": 3.0}),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", {"num_key_value_heads": 2, "sliding_window": 6}),
    "phi": ("PhiConfig", "PhiForCausalLM", {"partial_rotary_factor": 0.5}),
    "gpt_bigcode": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM", {**GPT, "multi_query": True}),  # one KV head
}
NEW_TOKENS = 20
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def make_model(path, arch: str, seed: int = 0, **overrides):
    """Save a tiny model of ARCHS[arch], every parameter random; returns it (float32, eval)."""
    import transformers

    config_cls, model_cls, extra = ARCHS[arch]
    config = getattr(transformers, config_cls)(**{**TINY, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            around = 1.0 if name.endswith("weight") and ("norm" in name or "ln" in name) else 0.0
            p.copy_(around + (0.2 if around else 0.08) * torch.randn_like(p))
    model.save_pretrained(str(path))
    save_tiny_tokenizer(path)
    return model


def prompts(seed: int = 11) -> list[list[int]]:
    """Three prompts of 12-17 tokens (several blocks of 4) sharing a 9-token prefix."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, 300, (9,), generator=g).tolist()
    return [shared + torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 3, 8)]


def tokens(outputs) -> list[list[int]]:
    return [o.completions[0].token_ids for o in outputs]


@pytest.fixture(scope="module", params=sorted(ARCHS))
def arch_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_model(path, request.param)
    return request.param, path, hf_greedy_past_eos(hf, prompts(), NEW_TOKENS)


def test_greedy_equals_transformers(arch_dir):
    arch, path, expected = arch_dir
    engine = LLMEngine(model=str(path), block_size=4, kv_tokens=1024, prefix_caching=True)
    assert engine.executor.config.impl == "transformers"  # auto: no native file
    assert tokens(engine.generate(prompts(), GREEDY)) == expected
    # again, one at a time: the shared prefix now comes from the prefix cache
    outs = [engine.generate([p], GREEDY)[0] for p in prompts()]
    assert tokens(outs) == expected
    assert all(o.cached_tokens >= 8 for o in outs)
    engine.memory.check_integrity()
    windowed = arch == "starcoder2"  # every layer windowed: blocks past the window go back
    assert engine.info.kv.window == (6 if windowed else 0)
    assert (engine.memory.allocator.blocks_released > 0) == windowed


@pytest.mark.parametrize("arch", ["gpt_neox", "gpt_bigcode"])
def test_greedy_equal_under_preemption(arch, tmp_path):
    hf = make_model(tmp_path, arch)
    expected = hf_greedy_past_eos(hf, prompts(), NEW_TOKENS)
    for mode in ("swap", "recompute"):
        engine = LLMEngine(model=str(tmp_path), block_size=4, kv_tokens=48, prefix_caching=False,
                           preemption_mode=mode)
        assert tokens(engine.generate(prompts(), GREEDY)) == expected, mode
        assert engine.memory.num_preemptions > 0
        assert_clean(engine.memory)


@pytest.mark.parametrize("family", [
    "qwen3",  # q/k norms, GQA, head_dim other than hidden / heads
    "gemma2",  # sliding windows on every other layer (shorter than the prompts), both soft-caps, tied head
])
def test_native_family_both_ways(tmp_path, family):
    hf = make_tiny_model(tmp_path, family, tie=family == "gemma2")
    save_tiny_tokenizer(tmp_path)
    expected = hf_greedy_past_eos(hf, prompts(), NEW_TOKENS)
    got, kv, windows = {}, {}, {}
    for impl in ("native", "transformers"):
        engine = LLMEngine(model=str(tmp_path), model_impl=impl, block_size=4, kv_tokens=1024)
        c = engine.executor.config
        assert c.impl == impl
        got[impl], kv[impl] = tokens(engine.generate(prompts(), GREEDY)), engine.info.kv
        windows[impl] = [c.layer_window(n) for n in range(c.num_layers)]
    assert got["native"] == got["transformers"] == expected
    assert kv["native"] == kv["transformers"]
    assert windows["native"] == windows["transformers"] == ([8, None] if family == "gemma2" else [None, None])


def test_generate_flag(tmp_path, capsys):
    make_model(tmp_path, "phi")
    argv = ["generate", "--model", str(tmp_path), "--prompt", "w5 w6 w7 w8", "--max-tokens", "4",
            "--ignore-eos", "--kv-tokens", "256", "--block-size", "4", "--device", "cpu", "--json"]
    capsys.readouterr()
    assert main([*argv, "--model-impl", "transformers"]) == 0
    assert len(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ids"]) == 4
    assert main([*argv, "--model-impl", "native"]) == 2
    msg = capsys.readouterr().err
    assert "unsupported architecture 'PhiForCausalLM'" in msg and "--model-impl transformers" in msg


def test_refused_at_load(tmp_path, monkeypatch):
    # config.json's KV heads disagree with what the attention layers compute
    make_model(tmp_path, "gpt_neox", num_key_value_heads=2)
    with pytest.raises(ModelLoadError, match=r"4 KV heads of size 16, but config.json reads as 2 KV heads"):
        LLMEngine(model=str(tmp_path), block_size=4, kv_tokens=256)
    # an LM head this backend does not reproduce: caught by the probe against eager attention
    make_model(tmp_path, "cohere")
    monkeypatch.setattr(transformers_backend.TransformersModel, "compute_logits", lambda self, h: self.head(h).float())
    with pytest.raises(ModelLoadError, match="differs from its own eager attention"):
        LLMEngine(model=str(tmp_path), block_size=4, kv_tokens=256)


def test_tensor_parallel_refused(tmp_path):
    make_model(tmp_path, "olmo2")
    with pytest.raises(ValueError, match="native models only"):
        LLMEngine(model=str(tmp_path), block_size=4, kv_tokens=256, tensor_parallel_size=2)
