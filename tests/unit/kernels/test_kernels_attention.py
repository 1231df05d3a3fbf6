"""pagedserve.kernels.paged_attention (torch path) against dense causal attention computed without paging."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from pagedserve.kernels import paged_attention, store_kv

TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny shapes: a second thread only adds waiting when the cores are shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_batch(specs, block_size, num_kv_heads, group, head_size=16, dtype=torch.float32,
               padding="negative", num_layers=3, layer=1, seed=0):
    """A pool holding random K/V for sequences given as (seq_len, q_len), in shuffled blocks."""
    gen = torch.Generator().manual_seed(seed)
    needed = [math.ceil(seq_len / block_size) for seq_len, _ in specs]
    num_blocks = sum(needed) + 4
    pool = torch.randn(num_blocks, num_layers, 2, block_size, num_kv_heads, head_size, generator=gen).to(dtype)
    width = max(needed) + 2
    if padding == "negative":
        tables = torch.full((len(specs), width), -1, dtype=torch.int32)
    else:
        tables = torch.randint(0, num_blocks, (len(specs), width), generator=gen, dtype=torch.int32)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    keys, values = [], []
    for b, (seq_len, _) in enumerate(specs):
        mine, order = order[: needed[b]], order[needed[b]:]
        tables[b, : needed[b]] = torch.tensor(mine, dtype=torch.int32)
        k = torch.randn(seq_len, num_kv_heads, head_size, generator=gen).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_size, generator=gen).to(dtype)
        for pos in range(seq_len):
            pool[mine[pos // block_size], layer, 0, pos % block_size] = k[pos]
            pool[mine[pos // block_size], layer, 1, pos % block_size] = v[pos]
        keys.append(k)
        values.append(v)
    q_lens = [q_len for _, q_len in specs]
    q = torch.randn(sum(q_lens), num_kv_heads * group, head_size, generator=gen).to(dtype)
    starts = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([seq_len for seq_len, _ in specs], dtype=torch.int32)
    return dict(q=q, k_cache=pool[:, layer, 0], v_cache=pool[:, layer, 1], block_tables=tables,
                seq_lens=seq_lens, query_start_loc=starts), keys, values


def dense_attention(q, keys, values, query_start_loc, scale, window=None, softcap=None):
    """Causal attention per sequence over contiguous K/V, explicit softmax in float64
    (optionally a sliding window of `window` positions and soft-capped scores)."""
    num_heads = q.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    starts = query_start_loc.tolist()
    for b, (k, v) in enumerate(zip(keys, values)):
        group = num_heads // k.shape[1]
        k = k.double().repeat_interleave(group, dim=1)
        v = v.double().repeat_interleave(group, dim=1)
        seq_len, q_len = k.shape[0], starts[b + 1] - starts[b]
        for i in range(q_len):
            pos = seq_len - q_len + i
            query = q[starts[b] + i].double()
            lo = 0 if window is None else max(0, pos - window + 1)
            scores = torch.einsum("hd,nhd->hn", query, k[lo: pos + 1]) * scale
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            out[starts[b] + i] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v[lo: pos + 1])
    return out


def check(specs, block_size, num_kv_heads, group, dtype=torch.float32, padding="negative", seed=0, head_size=16):
    args, keys, values = make_batch(specs, block_size, num_kv_heads, group, head_size, dtype, padding, seed=seed)
    scale = head_size ** -0.5
    out = torch.full_like(args["q"], float("nan"))
    result = paged_attention(**args, scale=scale, out=out)
    assert result.data_ptr() == out.data_ptr() and result.dtype == dtype
    expected = dense_attention(args["q"], keys, values, args["query_start_loc"], scale)
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    fresh = paged_attention(**args, scale=scale)
    torch.testing.assert_close(fresh, out, atol=0, rtol=0)


MIXED = [(37, 1), (5, 1), (64, 64), (50, 13), (1, 1), (33, 1), (17, 17), (90, 2)]


@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
@pytest.mark.parametrize("num_kv_heads,group", [(2, 1), (1, 3), (2, 8)])
def test_mixed_batch(block_size, num_kv_heads, group):
    check(MIXED, block_size, num_kv_heads, group, seed=block_size + group)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("padding", ["negative", "random"])
def test_half_dtypes(dtype, padding):
    check(MIXED, 16, 2, 3, dtype=dtype, padding=padding, head_size=32)


@pytest.mark.parametrize("padding", ["negative", "random"])
def test_decodes_only(padding):
    check([(n, 1) for n in (1, 7, 8, 9, 40, 64, 3)], 8, 3, 3, padding=padding)


def test_decodes_of_equal_full_blocks():
    check([(32, 1), (32, 1), (32, 1)], 16, 2, 2)


@pytest.mark.parametrize("padding", ["negative", "random"])
def test_prefills_only(padding):
    check([(23, 23), (40, 9), (16, 16), (2, 2), (31, 30)], 8, 1, 8, padding=padding)


def test_sequence_without_queries():
    check([(20, 1), (11, 0), (30, 5), (9, 0)], 4, 2, 3)


def test_noncontiguous_query_and_output():
    args, keys, values = make_batch(MIXED, 8, 2, 3, seed=3)
    q = args.pop("q")
    fused = torch.randn(q.shape[0], q.shape[1] * 2, q.shape[2])
    fused[:, ::2] = q
    out_storage = torch.full((q.shape[0], q.shape[1], q.shape[2] + 5), float("nan"))
    out = out_storage[:, :, :q.shape[2]]
    paged_attention(fused[:, ::2], **args, scale=0.3, out=out)
    expected = dense_attention(q, keys, values, args["query_start_loc"], 0.3)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)


@settings(max_examples=25, deadline=None)
@given(
    shapes=st.lists(st.tuples(st.integers(1, 70), st.integers(0, 70)), min_size=1, max_size=6),
    block_size=st.sampled_from([1, 2, 8, 16, 32]),
    heads=st.sampled_from([(1, 1), (2, 3), (1, 8), (3, 3)]),
    padding=st.sampled_from(["negative", "random"]),
    seed=st.integers(0, 1000),
)
def test_random_batches(shapes, block_size, heads, padding, seed):
    specs = [(seq_len, min(q_len, seq_len)) for seq_len, q_len in shapes]
    check(specs, block_size, heads[0], heads[1], padding=padding, seed=seed, head_size=8)


def test_store_then_attend_in_chunks():
    """An engine-like sequence of steps: prefill in chunks, then decodes, through store_kv."""
    gen = torch.Generator().manual_seed(7)
    block_size, num_kv_heads, group, head_size, num_layers = 4, 2, 3, 8, 2
    pool = torch.randn(12, num_layers, 2, block_size, num_kv_heads, head_size, generator=gen)
    k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]
    table = torch.tensor([[9, 2, 7, 0, 11, 5, -1]], dtype=torch.int32)
    keys = torch.randn(22, num_kv_heads, head_size, generator=gen)
    values = torch.randn(22, num_kv_heads, head_size, generator=gen)
    queries = torch.randn(22, num_kv_heads * group, head_size, generator=gen)
    done = 0
    for chunk in (6, 9, 1, 1, 1, 4):
        new = slice(done, done + chunk)
        positions = torch.arange(done, done + chunk)
        slots = table[0, positions // block_size].long() * block_size + positions % block_size
        store_kv(keys[new], values[new], k_cache, v_cache, slots)
        done += chunk
        out = paged_attention(queries[new], k_cache, v_cache, table, torch.tensor([done], dtype=torch.int32),
                              torch.tensor([0, chunk], dtype=torch.int32), 0.25)
        expected = dense_attention(queries[new], [keys[:done]], [values[:done]], torch.tensor([0, chunk]), 0.25)
        torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)


def poison_outside_window(args, window):
    """NaN in every block that lies wholly before all of its sequence's query windows: a
    kernel that reads one (even masked out) returns NaN."""
    block_size = args["k_cache"].shape[1]
    starts = args["query_start_loc"].tolist()
    for b, length in enumerate(args["seq_lens"].tolist()):
        q_len = starts[b + 1] - starts[b]
        first_pos = max(0, length - q_len - window + 1) if q_len else length
        for i in range(first_pos // block_size):
            blk = int(args["block_tables"][b, i])
            args["k_cache"][blk] = float("nan")
            args["v_cache"][blk] = float("nan")


@pytest.mark.parametrize("window,softcap", [(5, None), (16, None), (1, None), (None, 2.0), (7, 1.5)])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_sliding_window_and_softcap(window, softcap, block_size):
    args, keys, values = make_batch(MIXED, block_size, 2, 3, head_size=8, seed=block_size)
    if window is not None:
        poison_outside_window(args, window)
    out = paged_attention(**args, scale=0.4, window=window, softcap=softcap)
    expected = dense_attention(args["q"], keys, values, args["query_start_loc"], 0.4, window, softcap)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)
