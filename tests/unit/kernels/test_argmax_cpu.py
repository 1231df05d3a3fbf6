"""The C++ greedy argmax (pagedserve/kernels/argmax_cpu.py) against logits.max(-1).indices:
ties, NaN, infinities, widths not a multiple of eight, strided rows, no rows, and the paths
it leaves to torch."""
import pytest
import torch

from pagedserve.kernels import argmax_cpu
from tests.unit.kernels.test_kernels_cpu import two_threads  # noqa: F401 (autouse: rows split over two threads)

pytestmark = pytest.mark.skipif(not argmax_cpu.available(),
                                reason="the C++ kernels are not built here (pagedserve/kernels/native_build.py)")


def same(x):
    torch.testing.assert_close(argmax_cpu.greedy_ids(x), x.max(-1).indices, rtol=0, atol=0)


@pytest.mark.parametrize("rows,n", [(1, 1), (3, 7), (64, 8), (17, 49152), (20, 1001)])
def test_random_rows(rows, n):
    same(torch.randn(rows, n, generator=torch.Generator().manual_seed(rows * n)))


def test_ties_take_the_first_index():
    x = torch.zeros(16, 40)
    x[0, [3, 11, 19]] = 5.0  # the same value in three lanes and vectors
    x[1, [30, 2]] = 1.0
    x[2, 39] = 1.0
    x[3, [9, 1]] = 2.0  # lane 1 of two vectors
    same(x)
    assert argmax_cpu.greedy_ids(x)[:4].tolist() == [3, 2, 39, 1]


def test_nan_and_infinities():
    x = torch.randn(6, 37)
    x[0, 20] = float("nan")
    x[1, [5, 33]] = float("nan")
    x[2, 36] = float("nan")  # in the scalar tail
    x[3] = float("-inf")
    x[4, 12] = float("inf")
    x[5, [0, 9]] = float("inf")
    same(x)
    assert argmax_cpu.greedy_ids(x)[:3].tolist() == [20, 5, 36]


def test_strided_rows_and_no_rows():
    base = torch.randn(9, 80)
    same(base[:, :64])  # row stride 80
    assert argmax_cpu.greedy_ids(torch.empty(0, 64)).shape == (0,)


def test_others_take_torch():
    assert not argmax_cpu.applies(torch.randn(4, 8, dtype=torch.bfloat16))
    assert not argmax_cpu.applies(torch.randn(8, 4).t())
    x = torch.randn(4, 8, dtype=torch.float64)
    torch.testing.assert_close(argmax_cpu.greedy_ids(x), x.max(-1).indices)
