"""The CPU path (pagedserve/kernels/paged_cpu.py) against the torch reference it stands in for."""
import pytest
import torch

from pagedserve.kernels import paged_cpu, paged_prefill_cpu
from pagedserve.kernels.paged_attention_ref import paged_attention_ref
from pagedserve.kernels.store_kv_ref import store_kv_ref
from tests.unit.kernels.test_kernels_attention import make_batch


@pytest.fixture(autouse=True, scope="module")
def two_threads():
    """Two threads, so that the decode work is split across the helper pool."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def test_native_kernel_builds_here():
    assert paged_cpu.native_available(), "the C++ decode kernel did not build (is g++ installed?)"
    assert paged_prefill_cpu.native_available(), "the C++ prefill kernel did not build"


def test_prefill_takes_the_native_kernel(monkeypatch):
    """Prompt chunks go to the C++ prefill kernel, not the reference's per-sequence SDPA."""
    calls = []
    monkeypatch.setattr(paged_cpu, "_prefill", lambda *a: calls.append(a))
    args, _, _ = make_batch([(40, 40), (30, 7)], 16, 2, 2, 64)
    expected = paged_attention_ref(**args, scale=0.125)
    torch.testing.assert_close(paged_cpu.paged_attention_cpu(**args, scale=0.125), expected, atol=2e-6, rtol=2e-5)
    assert calls == []


@pytest.mark.parametrize("specs", [
    [(37, 1), (5, 1), (1, 1), (33, 1), (160, 1), (16, 1)] * 3,  # decodes only, split across threads
    [(37, 1), (64, 64), (5, 1), (50, 13), (90, 2), (1, 1)],  # mixed with prefill chunks
    [(200, 200), (45, 30), (17, 17), (130, 70), (33, 33), (16, 2)],  # prefills only: across tiles and blocks
    [(600, 600), (700, 40)],  # a chunk of 600 queries beside one after a cached prefix
])
@pytest.mark.parametrize("num_kv_heads,group,head_size", [(3, 3, 64), (2, 1, 16), (1, 4, 128), (1, 10, 64), (2, 8, 128)])
@pytest.mark.parametrize("padding", ["negative", "random"])
def test_cpu_attention_matches_reference(specs, num_kv_heads, group, head_size, padding):
    args, _, _ = make_batch(specs, 16, num_kv_heads, group, head_size, padding=padding)
    scale = head_size ** -0.5
    expected = paged_attention_ref(**args, scale=scale)
    out = torch.full_like(args["q"], float("nan"))
    got = paged_cpu.paged_attention_cpu(**args, scale=scale, out=out)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=2e-5)


def test_cpu_attention_strided_query_and_output():
    args, _, _ = make_batch([(20, 1), (3, 1), (40, 1)], 8, 2, 2, 16)
    q = args.pop("q")
    wide = torch.randn(q.shape[0], q.shape[1], 2 * q.shape[2])
    wide[..., ::2] = q
    out = torch.zeros(q.shape[0], q.shape[1], 2 * q.shape[2])
    paged_cpu.paged_attention_cpu(wide[..., ::2], **args, scale=0.25, out=out[..., 1::2])
    torch.testing.assert_close(out[..., 1::2], paged_attention_ref(q, **args, scale=0.25), atol=2e-6, rtol=2e-5)
    assert (out[..., ::2] == 0).all()


def test_store_kv_cpu_matches_reference():
    gen = torch.Generator().manual_seed(0)
    pool = torch.randn(6, 3, 2, 4, 2, 8, generator=gen)
    expected = pool.clone()
    key, value = torch.randn(5, 2, 8, generator=gen), torch.randn(5, 2, 8, generator=gen)
    slots = torch.tensor([3, -1, 23, 8, 0])
    paged_cpu.store_kv_cpu(key, value, pool[:, 1, 0], pool[:, 1, 1], slots)
    store_kv_ref(key, value, expected[:, 1, 0], expected[:, 1, 1], slots)
    assert torch.equal(pool, expected)


def test_cpu_path_under_inference_mode():
    """The model runs under inference_mode: its metadata tensors are inference tensors."""
    with torch.inference_mode():
        args, _, _ = make_batch([(20, 1), (3, 1), (40, 5)], 8, 2, 2, 16)
        expected = paged_attention_ref(**args, scale=0.25)
        for _ in range(2):  # the second call reuses the step's plan
            torch.testing.assert_close(paged_cpu.paged_attention_cpu(**args, scale=0.25), expected,
                                       atol=2e-6, rtol=2e-5)
        pool = torch.zeros(4, 2, 2, 4, 2, 8)
        slots = torch.tensor([1, 6])
        for _ in range(2):
            paged_cpu.store_kv_cpu(torch.ones(2, 2, 8), torch.ones(2, 2, 8), pool[:, 0, 0], pool[:, 0, 1], slots)
        assert pool[0, 0, :, 1].eq(1).all() and pool[1, 0, :, 2].eq(1).all() and pool.sum() == 2 * 2 * 2 * 8
