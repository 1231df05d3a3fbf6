"""The opt-in bfloat16 KV cache (--kv-cache-dtype) on the default model against a float32 one,
through the engine (BENCHMARKS.md has the six-prompt figures: max |logit diff| 0.24, 0.62% of
the logit spread, argmax agreement 100%, 6 of 6 continuations identical): a guard against a
regression, not a promise of equal outputs."""
from pagedserve.benchmarks.int8_accuracy import PROMPTS, compare


def engine(model_dir, kv_cache_dtype):
    from pagedserve.engine import LLMEngine

    return LLMEngine(model=model_dir, linear_backend="mkl", kv_tokens=1024, device="cpu",
                     kv_cache_dtype=kv_cache_dtype)


def test_default_model_bfloat16_kv_stays_near_float32(default_model_dir):
    float32, bf16 = engine(default_model_dir, "float32"), engine(default_model_dir, "bfloat16")
    assert bf16.info.kv.bytes_per_token * 2 == float32.info.kv.bytes_per_token
    r = compare(float32, bf16, PROMPTS[:3], new_tokens=16)
    assert r["argmax_agreement"] >= 0.98
    assert r["max_logit_diff_over_spread"] <= 0.02
    assert r["mean_tokens_before_divergence"] >= 12
