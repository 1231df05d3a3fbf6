"""The C++ panel kernel (pagedserve/kernels/panel_cpu.py) against F.linear, and a Linear routed to
it ("panel") against F.linear: row tails of every length below a tile, a last panel part
padded, panels cut in row ranges, K in chunks and odd, bias, a strided input, each unit computed
once however the threads share them, SiLU-and-multiply applied to a gate/up weight's own sums,
and a weight it refuses."""
import pytest
import torch
import torch.nn.functional as F

from pagedserve.executor.linear import Linear
from pagedserve.kernels import panel_cpu
from tests.unit.kernels.test_kernels_cpu import two_threads  # noqa: F401 (autouse: work split over two threads)
from tests.unit.kernels.test_linear_cpu import assert_matches_f_linear


def ref(x, w, b=None):
    return F.linear(x.double(), w.double(), None if b is None else b.double()).float()


def test_the_kernel_builds_here():
    assert panel_cpu.available(), "the C++ panel kernel did not build (is g++ installed?)"
    assert panel_cpu._native.get().panel_width() in (16, 64)


# (M, N, K): a decode's row; every tail below a 6-row tile; 9 panels of 64 (cut in row ranges
# over two threads) at a decode batch; the default model's gate/up and LM-head-like widths; a
# last panel part padded; K odd, K past MAX_K in two chunks; no rows
SHAPES = [(1, 5, 8), (7, 50, 16), (11, 97, 33), (64, 576, 576), (64, 3072, 64), (9, 576, 1536),
          (13, 130, 7), (5, 70, panel_cpu.MAX_K + 9), (0, 3, 8)]


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_matches_f_linear(m, n, k):
    assert_matches_f_linear(lambda x, w, bias: panel_cpu.matmul(x, panel_cpu.pack(w), bias), m, n, k)


def test_every_row_count_up_to_two_tiles_past_a_cut():
    # rows 1..30 over 9 panels: the row ranges of a panel cut for two threads end on every tail
    g = torch.Generator().manual_seed(5)
    w = torch.randn(9 * panel_cpu._native.get().panel_width(), 24, generator=g)
    packed = panel_cpu.pack(w)
    for m in range(1, 31):
        x = torch.randn(m, 24, generator=g)
        torch.testing.assert_close(panel_cpu.matmul(x, packed), ref(x, w), atol=1e-4, rtol=1e-4)


def ref_silu(x, w):
    gate, up = ref(x, w).double().chunk(2, -1)
    return (F.silu(gate) * up).float()


# (M, H, K), the gate/up weight [2H, K]: a decode's row, the default model at a decode batch,
# H not a multiple of a half panel, a row tail, K past MAX_K (one chunk here), no rows
GATED = [(1, 1536, 576), (64, 1536, 576), (11, 100, 64), (7, 13, panel_cpu.MAX_K + 9), (0, 24, 8)]


@pytest.mark.parametrize("m,h,k", GATED)
def test_silu_applied_to_its_own_sums_matches_silu_of_f_linear(m, h, k):
    g = torch.Generator().manual_seed(m * 1000 + h + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(2 * h, k, generator=g) / k ** 0.5
    packed = panel_cpu.pack(w)
    got = panel_cpu.matmul_silu(x, packed)
    assert got.shape == (m, h)
    torch.testing.assert_close(got, ref_silu(x, w), atol=1e-5, rtol=1e-5)
    strided = torch.randn(m, k + 16, generator=g)[:, 8:8 + k]
    torch.testing.assert_close(panel_cpu.matmul_silu(strided, packed), ref_silu(strided, w), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(panel_cpu.matmul(x, packed), ref(x, w), atol=1e-4 * k ** 0.5, rtol=1e-4)


def test_a_strided_input_is_read_in_place():
    g = torch.Generator().manual_seed(1)
    wide, w = torch.randn(6, 80, generator=g), torch.randn(10, 40, generator=g)
    x = wide[:, 8:48]  # row stride 80
    torch.testing.assert_close(panel_cpu.matmul(x, panel_cpu.pack(w)), ref(x, w), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("threads", [1, 3, 5])
def test_each_unit_is_computed_once_however_the_threads_share_them(threads):
    # more threads than cores: a descheduled thread's units are taken by the others; K in two
    # chunks, so a unit computed twice would add its first chunk twice
    g = torch.Generator().manual_seed(threads)
    k = panel_cpu.MAX_K + 8
    x, w = torch.randn(19, k, generator=g), torch.randn(7 * 64 + 5, k, generator=g)
    packed = panel_cpu.pack(w)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for _ in range(20):
            torch.testing.assert_close(panel_cpu.matmul(x, packed), ref(x, w), atol=1e-3, rtol=1e-4)
    finally:
        torch.set_num_threads(saved)


def test_what_it_refuses_it_names():
    assert "float32" in panel_cpu.unavailable(torch.ones(4, 16, dtype=torch.bfloat16))
    assert "[N, K]" in panel_cpu.unavailable(torch.ones(4))
    assert panel_cpu.unavailable(torch.ones(4, 12)) is None
    with pytest.raises(ValueError, match="float32"):
        panel_cpu.pack(torch.ones(4, 16, dtype=torch.bfloat16))


def test_a_layer_routed_to_it_holds_the_panels_and_drops_its_dense_weight():
    g = torch.Generator().manual_seed(2)
    w, b = torch.randn(30, 64, generator=g), torch.randn(30, generator=g)
    layer = Linear(w.clone(), b)
    layer.route([(None, "panel")])
    assert layer.routes == [(None, "panel")] and set(layer.prepared) == {"panel"}
    dense, prepared = layer.held_bytes()
    assert dense == 30 * 64 * 4 and prepared == panel_cpu.pack(w).nbytes
    assert layer.drop_dense() and layer.weight is None
    for rows in (1, 7, 33):
        x = torch.randn(2, rows, 64, generator=g)[1]
        torch.testing.assert_close(layer(x), ref(x, w, b), atol=1e-4, rtol=1e-4)
    three_d = torch.randn(2, 3, 64, generator=g)
    torch.testing.assert_close(layer(three_d), ref(three_d.reshape(6, 64), w, b).view(2, 3, 30), atol=1e-4, rtol=1e-4)

