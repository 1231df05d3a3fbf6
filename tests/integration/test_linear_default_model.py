"""The opt-in int4 and int8 weights on the default model, against float32 through the
engine (executor/linear_int4.py, executor/linear_int8.py; BENCHMARKS.md has the figures)."""
import pytest
import torch

from benchmarks.int8_accuracy import PROMPTS, compare
from executor import linear_backend, linear_int4

INT4 = linear_int4.unavailable(torch.device("cpu"), torch.float32) is None
INT8 = linear_backend.int8_unavailable(torch.device("cpu"), torch.float32) is None


@pytest.mark.skipif(not INT4, reason="no int4 CPU kernel in this torch build")
def test_default_model_int4_runs_and_stays_near_float32(default_model_dir):
    """The engine on int4 against float32 on the default model (BENCHMARKS.md has the
    six-prompt figures: max |logit diff| 0.73, 2.5% of the logit spread, argmax agreement 100%,
    6 of 6 continuations identical): a guard against a regression, not a promise of equal
    outputs."""
    from pagedserve.engine import LLMEngine

    engines = [LLMEngine(model=default_model_dir, linear_backend=b, kv_tokens=1024, device="cpu")
               for b in ("mkl", "int4")]
    plan = engines[1].executor.linear_plan
    assert sum(c.layers for c in plan if c.routes == [(None, "int4")]) == 4 * 30
    r = compare(*engines, PROMPTS[:3], new_tokens=16)
    assert r["argmax_agreement"] >= 0.95
    assert r["max_logit_diff_over_spread"] <= 0.05
    assert r["mean_tokens_before_divergence"] >= 8


@pytest.mark.skipif(not INT8, reason="no torch._weight_int8pack_mm in this torch build")
def test_default_model_int8_accuracy(default_model_dir):
    """Measured distance of int8 from float32 on the default model (BENCHMARKS.md has the
    six-prompt figures: max |logit diff| 2.17, 7% of the logit spread, argmax agreement 95%):
    a guard against a regression, not a promise of equal outputs."""
    from pagedserve.engine import LLMEngine

    engines = [LLMEngine(model=default_model_dir, linear_backend=b, kv_tokens=1024, device="cpu")
               for b in ("mkl", "int8")]
    r = compare(*engines, PROMPTS[:3], new_tokens=16)
    assert r["argmax_agreement"] >= 0.9
    assert r["max_logit_diff_over_spread"] <= 0.15
    assert r["mean_tokens_before_divergence"] >= 2
