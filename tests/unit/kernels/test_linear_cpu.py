"""The C++ linear kernel (pagedserve/kernels/linear_cpu.py) against F.linear, and a Linear routed
to it ("dot") against F.linear, through its tails (rows not a multiple of 4, weight rows not
a multiple of 3 or of a block), bias, a strided input and a weight it refuses; where a layer's
rows go to it or to the panel kernel, the layer applies SiLU-and-multiply itself."""
import logging

import pytest
import torch
import torch.nn.functional as F

from pagedserve.executor import linear_backend
from pagedserve.executor.linear import Linear
from pagedserve.kernels import linear_cpu
from tests.unit.kernels.test_kernels_cpu import two_threads  # noqa: F401 (autouse: blocks split over two threads)


def ref(x, w, b=None):
    return F.linear(x.double(), w.double(), None if b is None else b.double()).float()


def test_the_kernel_builds_here():
    assert linear_cpu.available(), "the C++ linear kernel did not build (is g++ installed?)"


# (M, N, K): a decode's row, a batch with a 4-row tail, blocks with 1- and 2-row tails, the
# default model's gate/up and down shapes at 9 rows (down's K in two chunks), K in two uneven
# chunks, no rows
SHAPES = [(1, 5, 8), (7, 50, 16), (64, 97, 64), (9, 3072, 576), (9, 576, 1536), (5, 2 * linear_cpu.BLOCK + 1, 24),
          (6, 7, linear_cpu.MAX_K + 8), (0, 3, 8)]


def assert_matches_f_linear(matmul, m, n, k):
    """matmul(x [m, k], weight [n, k], bias) against F.linear in float64, with and without a bias."""
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    for bias in (None, b):
        got = matmul(x, w, bias)
        assert got.shape == (m, n)
        torch.testing.assert_close(got, ref(x, w, bias), atol=1e-4 * k ** 0.5, rtol=1e-4)


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_matches_f_linear(m, n, k):
    assert_matches_f_linear(linear_cpu.matmul, m, n, k)


def test_a_strided_input_is_read_in_place():
    g = torch.Generator().manual_seed(1)
    wide, w = torch.randn(6, 80, generator=g), torch.randn(10, 40, generator=g)
    x = wide[:, 8:48]  # row stride 80
    torch.testing.assert_close(linear_cpu.matmul(x, w), ref(x, w), atol=1e-4, rtol=1e-4)


def test_what_it_refuses_it_names():
    assert "multiple of 8" in linear_cpu.unavailable(torch.ones(4, 12))
    assert "float32" in linear_cpu.unavailable(torch.ones(4, 16, dtype=torch.bfloat16))
    assert "contiguous" in linear_cpu.unavailable(torch.ones(16, 4).t())
    assert linear_cpu.unavailable(torch.ones(4, 16)) is None


def test_a_layer_routed_to_it_keeps_one_dense_weight():
    g = torch.Generator().manual_seed(2)
    w, b = torch.randn(30, 64, generator=g), torch.randn(30, generator=g)
    layer = Linear(w.clone(), b)
    layer.route([(8, "dot"), (None, "mkl")])
    assert layer.routes == [(8, "dot"), (None, "mkl")] and not layer.prepared
    assert not layer.drop_dense() and layer.weight is not None
    for rows in (1, 7, 8, 33):
        x = torch.randn(2, rows, 64, generator=g)[1]
        torch.testing.assert_close(layer(x), ref(x, w, b), atol=1e-4, rtol=1e-4)
    three_d = torch.randn(2, 3, 64, generator=g)
    torch.testing.assert_close(layer(three_d), ref(three_d.reshape(6, 64), w, b).view(2, 3, 30), atol=1e-4, rtol=1e-4)


def test_a_layer_it_cannot_serve_stays_on_f_linear(caplog):
    layer = Linear(torch.randn(4, 12))
    layer.route([(None, "dot")])
    assert layer.routes == [(None, "mkl")]
    assert "multiple of 8" in caplog.text


def test_dot_named_where_it_cannot_serve_is_f_linear_and_says_why(caplog):
    caplog.set_level(logging.INFO, logger="pagedserve.executor")  # the planner says why at INFO
    assert linear_backend.Planner("dot", dtype=torch.bfloat16).backend == "mkl"
    assert "float32 weights on the CPU" in caplog.text
    assert linear_backend.Planner("dot").backend == "dot"


def ref_silu(x, w):
    gate, up = ref(x, w).double().chunk(2, -1)
    return (F.silu(gate) * up).float()


@pytest.mark.parametrize("threads", [1, 3, 5])
def test_each_block_is_computed_once_however_the_threads_share_them(threads):
    # more threads than cores: a thread is often descheduled mid-call and the others take its
    # blocks; K in two chunks, so a block computed twice would add its first chunk twice
    g = torch.Generator().manual_seed(threads)
    x, w = torch.randn(9, linear_cpu.MAX_K + 8, generator=g), torch.randn(7 * linear_cpu.BLOCK + 5, linear_cpu.MAX_K + 8, generator=g)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for _ in range(20):
            torch.testing.assert_close(linear_cpu.matmul(x, w), ref(x, w, None), atol=1e-3, rtol=1e-4)
            torch.testing.assert_close(linear_cpu.matmul_silu(x, w[:-1] / 30), ref_silu(x, w[:-1] / 30), atol=1e-5, rtol=1e-5)
    finally:
        torch.set_num_threads(saved)


# (M, H, K), the gate/up weight [2H, K]: a decode's row, the default model at a decode batch and
# past one pass of GATED_ROWS (33, 65: a 1-row tail of a pass), blocks with tails, K in chunks
GATED = [(1, 1536, 576), (64, 1536, 576), (33, 100, 64), (65, 5, 16), (7, 13, linear_cpu.MAX_K + 8), (0, 24, 8)]


@pytest.mark.parametrize("m,h,k", GATED)
def test_silu_applied_to_its_own_sums_matches_silu_of_f_linear(m, h, k):
    g = torch.Generator().manual_seed(m * 1000 + h + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(2 * h, k, generator=g) / k ** 0.5
    got = linear_cpu.matmul_silu(x, w)
    assert got.shape == (m, h)
    torch.testing.assert_close(got, ref_silu(x, w), atol=1e-5, rtol=1e-5)
    strided = torch.randn(m, k + 16, generator=g)[:, 8:8 + k]
    torch.testing.assert_close(linear_cpu.matmul_silu(strided, w), ref_silu(strided, w), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["dot", "panel"])
def test_a_layer_applies_silu_itself_only_where_its_rows_go_to_a_cpp_kernel(monkeypatch, backend):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(60, 64, generator=g) / 8
    layer = Linear(w.clone())
    layer.route([(8, backend), (None, "mkl")])
    x = torch.randn(5, 64, generator=g)
    torch.testing.assert_close(layer.silu_gated(x), ref_silu(x, w), atol=1e-5, rtol=1e-5)
    assert layer.silu_gated(torch.randn(8, 64, generator=g)) is None  # MKL's rows: the caller applies it
    monkeypatch.setenv("PAGEDSERVE_FUSED_OPS", "0")
    assert layer.silu_gated(x) is None
    monkeypatch.delenv("PAGEDSERVE_FUSED_OPS")
    biased = Linear(w.clone(), torch.randn(60, generator=g))
    biased.route([(None, backend)])
    assert biased.silu_gated(x) is None
    odd = Linear(torch.randn(61, 64, generator=g))  # no gate/up halves
    odd.route([(None, backend)])
    assert odd.silu_gated(x) is None
