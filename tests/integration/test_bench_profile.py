"""`pagedserve bench profile` on a tiny model: both timed phases are full decode steps of
every sequence (it once ran out of tokens halfway, so the profiled steps were mostly empty
and the breakdown read several times too fast)."""
from pagedserve.benchmarks.profile import CATEGORIES, profile_batch
from pagedserve.engine import LLMEngine
from pagedserve.engine_config import EngineConfig
from tests.support.tiny_models import make_tiny_model, save_tiny_tokenizer


def test_profile_times_full_decode_steps_and_leaves_nothing_running(tmp_path):
    make_tiny_model(tmp_path, "llama_bias")
    save_tiny_tokenizer(tmp_path)
    engine = LLMEngine(EngineConfig.of(model=str(tmp_path), kv_tokens=2048))
    r = profile_batch(engine, batch=3, input_len=8, steps=8, warmup=1, seed=0)
    assert r["batch"] == 3 and r["step_ms"] > 0 and r["profiled_step_ms"] > 0
    assert set(r["breakdown_ms"]) == set(CATEGORIES) and r["breakdown_ms"]["matmul"] > 0
    assert not engine.loop.has_work()


def test_prompts_prefilled_over_many_steps_still_decode_through_both_timed_phases(tmp_path):
    """Six prompts in chunks of a few tokens: the first ones decode for many steps while the
    last prefill (their budget once counted only the timed steps, so they ended in the middle)."""
    make_tiny_model(tmp_path, "llama_bias")
    save_tiny_tokenizer(tmp_path)
    engine = LLMEngine(EngineConfig.of(model=str(tmp_path), kv_tokens=2048, max_num_batched_tokens=8))
    r = profile_batch(engine, batch=6, input_len=8, steps=4, warmup=1, seed=0)
    assert r["batch"] == 6 and r["step_ms"] > 0
    assert not engine.loop.has_work()


def test_the_cpp_linear_kernels_count_as_matmul_and_are_unwrapped_after(tmp_path):
    """The C++ kernels are ctypes calls, no torch op the profiler names: each call is scoped."""
    from pagedserve.kernels import panel_cpu

    make_tiny_model(tmp_path, "llama_bias")
    save_tiny_tokenizer(tmp_path)
    engine = LLMEngine(EngineConfig.of(model=str(tmp_path), kv_tokens=2048, linear_backend="panel"))
    matmul = panel_cpu.matmul
    r = profile_batch(engine, batch=3, input_len=8, steps=4, warmup=1, seed=0)
    assert "#matmul" in r["top_ops"] and r["breakdown_ms"]["matmul"] > 0
    assert panel_cpu.matmul is matmul
