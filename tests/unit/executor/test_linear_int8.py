"""The opt-in int8 weights (pagedserve/executor/linear_int8.py, --linear-backend int8): the quantization
and the kernel's contract, the fallback for shapes it cannot take, the layers it serves
holding no dense weight (its distance from float32 on the default model:
tests/integration/test_linear_default_model.py)."""
import logging

import pytest
import torch

from pagedserve.benchmarks.int8_accuracy import prefill_logits
from pagedserve.executor import linear_backend, linear_int8
from pagedserve.executor.linear import Linear
from pagedserve.executor.model_loader import load_model
from tests.support.tiny_models import make_tiny_model
from tests.unit.executor.test_linear_backend import log_records  # noqa: F401 (fixture)

INT8 = linear_backend.int8_unavailable(torch.device("cpu"), torch.float32) is None
pytestmark = pytest.mark.skipif(not INT8, reason="no torch._weight_int8pack_mm in this torch build")


def dequantized(w: linear_int8.Int8Weight) -> torch.Tensor:
    return w.q.double() * w.scales.double()[:, None]


def test_quantize_is_per_channel_and_within_half_a_step():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=g) * torch.logspace(-3, 1, 48)[:, None]  # rows of every scale
    w[5] = 0
    q = linear_int8.quantize(w)
    assert q.q.dtype == torch.int8 and q.scales.dtype == torch.bfloat16 and q.q.abs().max() <= 127
    step = q.scales.double()[:, None]
    amax = w.abs().amax(1, keepdim=True).double()
    assert ((dequantized(q) - w.double()).abs() <= step / 2 + amax * 2 ** -8).all()  # + the bf16 scale's rounding
    assert (q.q[5] == 0).all()


@pytest.mark.parametrize("m", [1, 3, 64])
def test_matmul_is_the_bfloat16_product_of_the_int8_weights(m):
    g = torch.Generator().manual_seed(1)
    w, bias = torch.randn(40, 96, generator=g) * 0.1, torch.randn(40, generator=g)
    x = torch.randn(m, 96, generator=g)
    q = linear_int8.quantize(w)
    got = linear_int8.matmul(x, q, bias)
    assert got.dtype == torch.float32 and got.shape == (m, 40)
    exact = x.bfloat16().double() @ dequantized(q).T  # what the kernel computes, before rounding
    product = got.double() - bias.double()  # the bias is added after the bfloat16 rounding
    assert ((product - exact).abs() <= exact.abs() * 2 ** -8 + 1e-6).all()


def test_a_view_at_an_offset_is_realigned():
    q = linear_int8.quantize(torch.randn(8, 32))
    x = torch.randn(5, 32).bfloat16()
    torch.testing.assert_close(linear_int8.matmul(x[1:], q, None), linear_int8.matmul(x[1:].clone(), q, None))


def test_a_shape_the_kernel_cannot_take_stays_on_f_linear(log_records):  # noqa: F811
    layer = Linear(torch.randn(12, 20))  # in_features 20: not a multiple of 16
    layer.route([(None, "int8")])
    assert layer.routes == [(None, "mkl")] and not layer.prepared
    assert any("multiple of 16" in r.getMessage() and "F.linear" in r.getMessage() for r in log_records)
    x = torch.randn(3, 20)
    torch.testing.assert_close(layer(x), x @ layer.weight.T)


def test_int8_never_chosen_by_auto():
    assert "int8" in linear_backend.CHOICES and "int8" not in linear_backend.TIMED


@pytest.mark.parametrize("tie", [True, False])
def test_tiny_model_on_int8_holds_no_dense_weight_and_stays_near_float32(tmp_path, tie):
    make_tiny_model(tmp_path, "qwen2", tie=tie)
    ref, config = load_model(str(tmp_path))
    planner = linear_backend.Planner("int8")
    model, _ = load_model(str(tmp_path), on_built=planner.place)
    plan = planner.finish()
    assert plan and all(c.routes == [(None, "int8")] for c in plan)
    for m in model.modules():
        if isinstance(m, Linear):
            assert isinstance(m.prepared["int8"], linear_int8.Int8Weight)
            assert (m.weight is model.embed) if (tie and m is model.lm_head) else m.weight is None
    g = torch.Generator().manual_seed(3)
    for n in (21, 9):
        ids = torch.randint(0, config.vocab_size, (n,), generator=g).tolist()
        a, b = prefill_logits(ref, config, ids), prefill_logits(model, config, ids)
        spread = (a.amax(-1) - a.amin(-1)).min().item()
        assert (a - b).abs().max().item() <= 0.05 * spread
