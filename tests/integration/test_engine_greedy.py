"""The offline engine against transformers on the default model: greedy continuations token
for token, in a batch and one by one, across block sizes, prefix caching and preemption.
transformers' continuations are checked against ours by one forward pass per prompt, and
generated token by token only where they differ (tests/support/hf_reference.py)."""
import pytest

from pagedserve.engine import LLMEngine
from pagedserve.wire.protocol import SamplingParams
from tests.support.hf_reference import hf_greedy

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
def prompt_ids(hf_default):
    tok, _ = hf_default
    return [tok.encode(p, add_special_tokens=False) for p in PROMPTS]


@pytest.fixture
def expected(hf_default, prompt_ids):
    """transformers' greedy continuations, one prompt at a time (no padding effects), of the
    prompts (all, the first n, or those at `which`) given our engine's
    (tests/support/hf_reference.py)."""
    _, model = hf_default

    def expected(got, n=len(PROMPTS), which=None):
        chosen = prompt_ids[:n] if which is None else [prompt_ids[i] for i in which]
        return hf_greedy(model, chosen, got, NEW_TOKENS)
    return expected


def greedy():
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def run(engine, prompt_ids, batched):
    if batched:
        return [o.completions[0].token_ids for o in engine.generate(prompt_ids, greedy())]
    return [engine.generate([p], greedy())[0].completions[0].token_ids for p in prompt_ids]


ALL, EVEN, ODD = range(len(PROMPTS)), range(0, len(PROMPTS), 2), range(1, len(PROMPTS), 2)


# Every pair of (block size, prefix caching, batched) settings is covered, and every prompt runs
# alone once: the two one-by-one cases (a decode step of one sequence each, ~25 ms) split the
# prompts between them.
@pytest.mark.parametrize("block_size, prefix, batched, which", [
    (16, True, True, ALL), (16, False, False, EVEN), (1, True, False, ODD), (1, False, True, ALL),
], ids=["block16-prefix-batched", "block16-alone-even", "block1-prefix-alone-odd", "block1-batched"])
def test_greedy_matches_transformers(default_model_dir, prompt_ids, expected, block_size, prefix, batched,
                                     which):
    engine = LLMEngine(model=default_model_dir, block_size=block_size, kv_tokens=4096,
                       prefix_caching=prefix)
    got = run(engine, [prompt_ids[i] for i in which], batched)
    assert got == expected(got, which=which)
    engine.memory.check_integrity()
    assert engine.memory.stats().snapshot["blocks_referenced"] == 0


def test_greedy_matches_under_preemption_by_recompute(default_model_dir, prompt_ids, expected):
    longest = max(len(p) for p in prompt_ids) + NEW_TOKENS
    engine = LLMEngine(model=default_model_dir, block_size=4, kv_tokens=2 * longest + 8,
                       prefix_caching=False)
    got = run(engine, prompt_ids, batched=True)
    assert got == expected(got)
    assert engine.loop.scheduler.num_preemptions > 0
    engine.memory.check_integrity()


def test_chunked_prefill_matches(default_model_dir, prompt_ids, expected):
    engine = LLMEngine(model=default_model_dir, kv_tokens=4096, max_num_batched_tokens=7)
    got = run(engine, prompt_ids[:3], batched=True)
    assert got == expected(got, n=3)


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(default_model_dir, prompt_ids):
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
