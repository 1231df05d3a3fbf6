"""The C++ prefill kernel (pagedserve/kernels/paged_prefill_cpu.py) against the torch reference on
long chunks: past a thousand queries, after a cached prefix, with query heads sharing a kv head,
block sizes 16 and 32, head sizes that are and are not a multiple of the vector width, scores
whose maximum moves from key to key, and NaN past every context never read. The native build
here; tests/integration/test_prefill_cpu_avx2.py runs these on the AVX2-only build."""
import pytest
import torch

from pagedserve.kernels import paged_cpu, paged_prefill_cpu
from pagedserve.kernels.paged_attention_ref import paged_attention_ref
from tests.unit.kernels.test_kernels_attention import make_batch


@pytest.fixture
def build():
    """The prefill kernel as built for this session."""
    assert paged_prefill_cpu.native_available()
    return "default"


def kernel(args, scale, monkeypatch):
    """paged_attention_cpu with the reference's per-sequence path forbidden, on two threads."""
    monkeypatch.setattr(paged_cpu, "_prefill", lambda *a: pytest.fail("a chunk took the SDPA path"))
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = torch.full_like(args["q"], float("nan"))
        return paged_cpu.paged_attention_cpu(**args, scale=scale, out=out)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("specs", [
    [(1100, 1100)],  # one long chunk, no prefix
    [(900, 600), (37, 37), (530, 513)],  # after cached prefixes of 300 and 17, beside a short chunk
])
@pytest.mark.parametrize("num_kv_heads,group,head_size", [(3, 3, 64), (1, 8, 128), (2, 1, 64), (1, 5, 40)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_long_chunks_match_reference(build, monkeypatch, specs, num_kv_heads, group, head_size, block_size):
    args, _, _ = make_batch(specs, block_size, num_kv_heads, group, head_size)
    scale = head_size ** -0.5
    expected = paged_attention_ref(**args, scale=scale)
    torch.testing.assert_close(kernel(args, scale, monkeypatch), expected, atol=2e-6, rtol=2e-5)


def test_maximum_moving_between_keys(build, monkeypatch):
    """Keys growing along the context (x1 to x4): most queries' largest score lies past the first
    step, so the running max and sum are rescaled step after step. Scores reach about 20, where
    float32 itself is off by some 1e-6: the kernel is held to float64, no further from it than
    the float32 reference is (plus 1e-6)."""
    block_size, length = 16, 700
    args, _, _ = make_batch([(length, length)], block_size, 1, 3, 64)
    ramp = torch.linspace(1, 4, length)
    for pos in range(length):
        args["k_cache"][args["block_tables"][0, pos // block_size], pos % block_size] *= ramp[pos]
    args["q"].mul_(1.5)
    exact = paged_attention_ref(**{k: v.double() if v.is_floating_point() else v for k, v in args.items()},
                                scale=0.125)
    reference_error = (paged_attention_ref(**args, scale=0.125).double() - exact).abs().max().item()
    error = (kernel(args, 0.125, monkeypatch).double() - exact).abs().max().item()
    assert error <= 2 * reference_error + 1e-6, (error, reference_error)


def test_nan_past_the_contexts_is_never_read(build, monkeypatch):
    """Pool rows past each sequence's length and blocks no table names hold NaN: none reaches the output."""
    specs, block_size = [(611, 600), (45, 30)], 16
    args, _, _ = make_batch(specs, block_size, 2, 3, 64, padding="random")
    expected = paged_attention_ref(**args, scale=0.125)
    used = torch.zeros(args["k_cache"].shape[:2], dtype=torch.bool)
    for b, (length, _) in enumerate(specs):
        for pos in range(length):
            used[args["block_tables"][b, pos // block_size], pos % block_size] = True
    for cache in (args["k_cache"], args["v_cache"]):
        cache[~used] = float("nan")
    got = kernel(args, 0.125, monkeypatch)
    assert not got.isnan().any()
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=2e-5)
