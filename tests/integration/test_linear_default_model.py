"""The opt-in int4 and int8 weights on the default model, against float32 through the
engine (pagedserve/executor/linear_int4.py, pagedserve/executor/linear_int8.py; BENCHMARKS.md has the figures)."""
import pytest
import torch

from pagedserve.benchmarks.int8_accuracy import PROMPTS, compare
from pagedserve.executor import linear_backend, linear_int4

INT4 = linear_int4.unavailable(torch.device("cpu"), torch.float32) is None
INT8 = linear_backend.int8_unavailable(torch.device("cpu"), torch.float32) is None


def engine(model_dir, backend):
    from pagedserve.engine import LLMEngine

    return LLMEngine(model=model_dir, linear_backend=backend, kv_tokens=1024, device="cpu")


@pytest.fixture(scope="module")
def float32(default_model_dir):
    """The float32 reference engine both tests compare with (as `python -m
    pagedserve.benchmarks.int8_accuracy` compares each candidate with one reference)."""
    return engine(default_model_dir, "mkl")


@pytest.mark.skipif(not INT4, reason="no int4 CPU kernel in this torch build")
def test_default_model_int4_runs_and_stays_near_float32(default_model_dir, float32):
    """The engine on int4 against float32 on the default model (BENCHMARKS.md has the
    six-prompt figures: max |logit diff| 0.73, 2.5% of the logit spread, argmax agreement 100%,
    6 of 6 continuations identical): a guard against a regression, not a promise of equal
    outputs."""
    int4 = engine(default_model_dir, "int4")
    assert sum(c.layers for c in int4.executor.linear_plan if c.routes == [(None, "int4")]) == 4 * 30
    r = compare(float32, int4, PROMPTS[:3], new_tokens=16)
    assert r["argmax_agreement"] >= 0.95
    assert r["max_logit_diff_over_spread"] <= 0.05
    assert r["mean_tokens_before_divergence"] >= 8


@pytest.mark.skipif(not INT8, reason="no torch._weight_int8pack_mm in this torch build")
def test_default_model_int8_accuracy(default_model_dir, float32):
    """Measured distance of int8 from float32 on the default model (BENCHMARKS.md has the
    six-prompt figures: max |logit diff| 2.17, 7% of the logit spread, argmax agreement 95%):
    a guard against a regression, not a promise of equal outputs."""
    r = compare(float32, engine(default_model_dir, "int8"), PROMPTS[:3], new_tokens=16)
    assert r["argmax_agreement"] >= 0.9
    assert r["max_logit_diff_over_spread"] <= 0.15
    assert r["mean_tokens_before_divergence"] >= 2


def test_default_model_on_the_panels_matches_float32(default_model_dir, float32):
    """The C++ panel kernel (pagedserve/kernels/panel_cpu.py) at every M of every layer, named as
    `auto` may pick it: exact float32 up to the order of the sums, so the same greedy tokens."""
    panel = engine(default_model_dir, "panel")
    assert all(c.routes == [(None, "panel")] for c in panel.executor.linear_plan)
    r = compare(float32, panel, PROMPTS[:3], new_tokens=16)
    assert r["argmax_agreement"] == 1.0
    assert r["max_logit_diff_over_spread"] <= 1e-4
    assert r["mean_tokens_before_divergence"] == 16
