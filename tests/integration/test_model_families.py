"""Each model family, tiny and random, through the offline engine: greedy continuations equal
transformers' token for token over a context longer than the sliding window (prefix caching
on, batched, block size 4), and `pagedserve generate --model DIR` for each family."""
import json

import pytest
import torch

from pagedserve.cli import main
from pagedserve.engine import LLMEngine
from pagedserve.wire.protocol import SamplingParams
from tests.support.tiny_models import make_tiny_model, save_tiny_tokenizer

FAMILIES = ["mistral_swa", "qwen2_swa", "gemma2", "gemma3", "phi3", "mixtral"]
NEW_TOKENS = 30


@pytest.fixture(scope="module", params=FAMILIES)
def family_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_model(path, request.param, tie=request.param.startswith("gemma"))
    save_tiny_tokenizer(path)
    return request.param, path, hf


def test_greedy_matches_transformers_past_the_window(family_dir):
    arch, path, hf = family_dir
    cfg = json.loads((path / "config.json").read_text())
    window = cfg.get("sliding_window")
    g = torch.Generator().manual_seed(11)
    shared = torch.randint(3, 300, (9,), generator=g).tolist()
    prompts = [shared + torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 3, 8)]
    expected = []
    hf.generation_config.eos_token_id = None
    for p in prompts:
        with torch.inference_mode():
            y = hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        expected.append(y[0, len(p):].tolist())
    assert window is not None and len(prompts[0]) + NEW_TOKENS > 3 * window
    engine = LLMEngine(model=str(path), block_size=4, kv_tokens=1024, prefix_caching=True)
    sampling = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    got = [o.completions[0].token_ids for o in engine.generate(prompts, sampling)]
    assert got == expected
    # again, one at a time: the shared prefix now comes from the prefix cache
    got = [engine.generate([p], sampling)[0].completions[0].token_ids for p in prompts]
    assert got == expected
    engine.memory.check_integrity()
    # every layer windowed (Mistral, Phi-3, Mixtral): blocks past the window went back to the pool
    every_layer = engine.info.kv.window > 0
    assert every_layer == (arch in ("mistral_swa", "phi3", "mixtral"))
    assert (engine.memory.allocator.blocks_released > 0) == every_layer


def test_pagedserve_generate_runs_each_family(family_dir, capsys):
    arch, path, _ = family_dir
    if arch == "qwen2_swa":
        pytest.skip("transformers forces Qwen2Tokenizer for model_type qwen2, which cannot read the "
                    "tiny word-level tokenizer (Qwen2 itself is served from real checkpoints)")
    rc = main(["generate", "--model", str(path), "--prompt", "w5 w6 w7 w8", "--max-tokens", "6",
               "--ignore-eos", "--kv-tokens", "512", "--block-size", "4", "--device", "cpu", "--json"])
    captured = capsys.readouterr()
    out = captured.out
    assert rc == 0, captured.err
    assert json.loads(out.strip().splitlines()[-1])


def test_pagedserve_generate_unsupported_architecture(tmp_path, capsys):
    make_tiny_model(tmp_path, "qwen2")
    save_tiny_tokenizer(tmp_path)
    capsys.readouterr()
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["FalconForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    argv = ["generate", "--model", str(tmp_path), "--prompt", "w5", "--max-tokens", "2", "--device", "cpu"]
    assert main([*argv, "--model-impl", "native"]) == 2
    msg = capsys.readouterr().err
    assert msg.startswith("pagedserve generate: ") and "unsupported architecture" in msg
    assert "FalconForCausalLM" in msg and "Gemma2ForCausalLM" in msg and "config.json" in msg
    # auto: no native file, so the Transformers backend, which refuses a config of another model type
    assert main(argv) == 2
    msg = capsys.readouterr().err
    assert msg.startswith("pagedserve generate: ") and "config.json" in msg
    assert "'FalconForCausalLM', but model_type 'qwen2' is transformers' Qwen2ForCausalLM" in msg
