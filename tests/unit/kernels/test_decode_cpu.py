"""The C++ decode kernel's fast path (head sizes 64 and 128, 1-8 query heads per kv head: one
pass with an online softmax) against float64 attention over the same K/V: lengths on and
across block boundaries, block sizes that are and are not a multiple of the vector width,
scores whose maximum moves from block to block, and NaN past every length never read. The
native build here; tests/integration/test_decode_cpu_avx2.py runs these on the AVX2-only
build (-march=haswell: a compile, which a unit test may not start). Also a bfloat16 cache,
read in float32 arithmetic."""
import pytest
import torch

from pagedserve.kernels import paged_cpu, paged_decode_cpu
from tests.unit.kernels.test_kernels_attention import make_batch


@pytest.fixture
def build():
    """The decode kernel as built for this session (the unit guard builds it first)."""
    assert paged_decode_cpu.native_available()
    return "default"


def decode(args, scale, threads=2):
    q, lens = args["q"].float(), args["seq_lens"]
    out = torch.full_like(q, float("nan"))
    rows = torch.arange(len(lens), dtype=torch.int64)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        paged_decode_cpu.paged_decode(q, args["k_cache"], args["v_cache"], args["block_tables"], lens, rows,
                                      scale, out)
    finally:
        torch.set_num_threads(previous)
    return out


def expected(q, keys, values, scale):
    rows = []
    for b, (k, v) in enumerate(zip(keys, values)):
        group = q.shape[1] // k.shape[1]
        k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
        probs = torch.softmax(torch.einsum("hd,thd->ht", q[b].double() * scale, k), dim=-1)
        rows.append(torch.einsum("ht,thd->hd", probs, v))
    return torch.stack(rows).float()


LENS = [1, 15, 16, 17, 31, 32, 33, 100, 257]


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("kv_heads,group,head_size", [(3, 3, 64), (1, 8, 64), (2, 1, 128), (1, 4, 128)])
def test_fast_path_matches_float64(build, block_size, kv_heads, group, head_size):
    args, keys, values = make_batch([(n, 1) for n in LENS], block_size, kv_heads, group, head_size)
    scale = head_size ** -0.5
    torch.testing.assert_close(decode(args, scale), expected(args["q"], keys, values, scale), atol=2e-6, rtol=2e-5)


def test_maximum_moving_between_blocks(build):
    """Keys aligned ever more with the query, so each block's scores top the ones before and
    the accumulated sums are rescaled at every block; then the reverse order."""
    args, keys, values = make_batch([(200, 1), (200, 1)], 16, 3, 3, 64)
    q = args["q"]
    for b, sign in ((0, 1.0), (1, -1.0)):
        ramp = torch.linspace(-4, 4, 200)[:, None, None] * sign
        keys[b] = keys[b] * 0.1 + ramp * q[b].view(3, 3, 64).mean(1)[None]
        table = args["block_tables"][b]
        layer = args["k_cache"]
        for pos in range(200):
            layer[table[pos // 16], pos % 16] = keys[b][pos]
    got, want = decode(args, 0.5), expected(q, keys, values, 0.5)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-5)


def test_nan_past_the_lengths_is_never_read(build):
    args, keys, values = make_batch([(n, 1) for n in LENS], 16, 3, 3, 64)
    for b, n in enumerate(LENS):
        table = args["block_tables"][b]
        last = table[(n - 1) // 16]
        args["k_cache"][last, (n - 1) % 16 + 1:] = float("nan")
        args["v_cache"][last, (n - 1) % 16 + 1:] = float("nan")
        table[(n - 1) // 16 + 1:] = -1  # padding entries past the last block
    got = decode(args, 0.125, threads=1)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected(args["q"], keys, values, 0.125), atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("kv_heads,group,head_size", [(3, 3, 64), (2, 1, 128), (1, 10, 64), (2, 2, 16)])
def test_bfloat16_cache_in_float32_arithmetic(build, kv_heads, group, head_size):
    """A bfloat16 cache is read as the float32 numbers it holds (fast path and generic loop
    alike), and paged_attention_cpu sends its decodes to the kernel: the same result as
    float64 attention over those numbers, to float32 rounding."""
    args, keys, values = make_batch([(n, 1) for n in LENS], 16, kv_heads, group, head_size, dtype=torch.bfloat16)
    args["q"] = args["q"].float()
    assert args["k_cache"].dtype == torch.bfloat16
    scale = head_size ** -0.5
    want = expected(args["q"], keys, values, scale)
    torch.testing.assert_close(decode(args, scale), want, atol=2e-6, rtol=2e-5)
    got = paged_cpu.paged_attention_cpu(**args, scale=scale)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-5)
