"""The offline engine against transformers on the default model: greedy continuations token
for token, in a batch and one by one, across block sizes, prefix caching and preemption."""
import pytest
import torch

from pagedserve.engine import LLMEngine
from wire.protocol import SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "A paged key-value cache stores attention keys and values in fixed-size blocks so that",
    "1, 2, 3, 4, 5,",
    "The quick brown fox",
]
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def reference(default_model_dir):
    """transformers' greedy generate, one prompt at a time (no padding effects)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # run past EOS like ignore_eos, without masking it
    ids, outs = [], []
    for p in PROMPTS:
        x = tok.encode(p, add_special_tokens=False)
        with torch.inference_mode():
            y = model.generate(torch.tensor([x]), max_new_tokens=NEW_TOKENS, do_sample=False,
                               pad_token_id=0)
        ids.append(x)
        outs.append(y[0, len(x):].tolist())
    return ids, outs


def greedy():
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def run(engine, prompt_ids, batched):
    if batched:
        return [o.completions[0].token_ids for o in engine.generate(prompt_ids, greedy())]
    return [engine.generate([p], greedy())[0].completions[0].token_ids for p in prompt_ids]


@pytest.mark.parametrize("block_size, prefix, batched", [
    (16, True, True), (16, False, False), (1, True, False), (1, False, True),
])
def test_greedy_matches_transformers(default_model_dir, reference, block_size, prefix, batched):
    prompt_ids, expected = reference
    engine = LLMEngine(model=default_model_dir, block_size=block_size, kv_tokens=4096,
                       prefix_caching=prefix)
    assert run(engine, prompt_ids, batched) == expected
    engine.memory.check_integrity()
    assert engine.memory.stats().snapshot["blocks_referenced"] == 0


def test_greedy_matches_under_preemption_by_recompute(default_model_dir, reference):
    prompt_ids, expected = reference
    longest = max(len(p) for p in prompt_ids) + NEW_TOKENS
    engine = LLMEngine(model=default_model_dir, block_size=4, kv_tokens=2 * longest + 8,
                       prefix_caching=False)
    assert run(engine, prompt_ids, batched=True) == expected
    assert engine.loop.scheduler.num_preemptions > 0
    engine.memory.check_integrity()


def test_chunked_prefill_matches(default_model_dir, reference):
    prompt_ids, expected = reference
    engine = LLMEngine(model=default_model_dir, kv_tokens=4096, max_num_batched_tokens=7)
    assert run(engine, prompt_ids[:3], batched=True) == expected[:3]


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(default_model_dir, reference):
    prompt_ids, _ = reference
    engine = LLMEngine(model=default_model_dir, kv_tokens=4096)
    sp = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    alone = engine.generate([prompt_ids[0]], sp)[0].completions[0].token_ids
    others = [SamplingParams(max_tokens=16, temperature=1.0, seed=i) for i in range(5)]
    batch = engine.generate([prompt_ids[0]] + prompt_ids[1:6], [sp] + others)
    assert batch[0].completions[0].token_ids == alone
    assert len(set(tuple(o.completions[0].token_ids) for o in batch)) > 1


def test_chat_generation_answers_and_strips_eos(default_model_dir):
    engine = LLMEngine(model=default_model_dir, kv_tokens=2048)
    out = engine.generate(["What is the capital of France?"],
                          SamplingParams(max_tokens=32, temperature=0.0), chat=True)[0]
    c = out.completions[0]
    assert "Paris" in c.text and "<|im_end|>" not in c.text
    assert c.finish_reason == "stop"
