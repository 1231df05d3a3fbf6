"""Preemption by swap, recompute or either leaves the default model's greedy outputs as
they are with room for everything, and the pool clean."""
from pagedserve.wire.protocol import SamplingParams
from tests.unit.gateway.test_preemption import assert_clean


def test_real_model_greedy_is_the_same_whatever_preempts(default_model_dir):
    from pagedserve.engine import LLMEngine

    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time,", "1, 2, 3, 4,"]
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    engine = LLMEngine(model=default_model_dir, block_size=4, kv_tokens=4096)
    prompt_ids = [engine.encode(t) for t in texts]
    roomy = [o.completions[0].token_ids for o in engine.generate(prompt_ids, sp)]
    for mode in ("swap", "recompute", "auto"):
        engine = LLMEngine(model=default_model_dir, block_size=4, kv_tokens=112,
                           prefix_caching=False, preemption_mode=mode)
        assert [o.completions[0].token_ids for o in engine.generate(prompt_ids, sp)] == roomy, mode
        s = engine.memory.stats().preemption
        assert s["num_swapped_out"] + s["num_recomputed"] == engine.memory.num_preemptions > 0
        if mode != "auto":
            assert s["num_swapped_out" if mode == "swap" else "num_recomputed"] > 0
        assert_clean(engine.memory)
