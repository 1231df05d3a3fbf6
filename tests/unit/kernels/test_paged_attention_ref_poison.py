"""pagedserve.kernels.paged_attention_ref (and the CPU path over it) never lets what lies past a
sequence's length reach the output: the tail of its last block and the blocks its padding
entries name are filled with NaN, and every dtype, decode-only or mixed with prefill chunks,
gives the same finite result as over a clean pool."""
import pytest
import torch

from pagedserve.kernels import paged_attention
from pagedserve.kernels.paged_attention_ref import paged_attention_ref

BLOCK = 4


def poisoned_batch(q_lens, seq_lens, dtype, padding_id):
    """Sequences with their own shuffled blocks, a table 2 columns wider than the longest,
    padding entries naming `padding_id`; returns (args over a NaN-poisoned pool, args over
    the same pool with finite numbers where the poison is)."""
    gen = torch.Generator().manual_seed(len(seq_lens))
    per_seq = [-(-n // BLOCK) for n in seq_lens]
    num_blocks = sum(per_seq) + 2  # block 0 and the last are never a sequence's
    pool = torch.randn(num_blocks, 2, BLOCK, 2, 8, generator=gen).to(dtype)
    order = (torch.randperm(num_blocks - 2, generator=gen) + 1).tolist()
    tables = torch.full((len(seq_lens), max(per_seq) + 2), padding_id, dtype=torch.int32)
    poisoned = pool.clone()
    poisoned[0] = poisoned[-1] = float("nan")
    for b, n in enumerate(seq_lens):
        mine, order = order[: per_seq[b]], order[per_seq[b]:]
        tables[b, : per_seq[b]] = torch.tensor(mine, dtype=torch.int32)
        poisoned[mine[-1], :, (n - 1) % BLOCK + 1:] = float("nan")
    starts = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    q = torch.randn(int(starts[-1]), 4, 8, generator=gen).to(dtype)
    common = dict(q=q, block_tables=tables, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                  query_start_loc=starts)
    return (dict(common, k_cache=poisoned[:, 0], v_cache=poisoned[:, 1]),
            dict(common, k_cache=pool[:, 0], v_cache=pool[:, 1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("q_lens, seq_lens", [
    ([1, 1, 1], [3, 9, 5]),  # decode-only, lengths mixed: the batched SDPA path
    ([1, 3, 1], [6, 7, 2]),  # decodes beside a prefill chunk
])
@pytest.mark.parametrize("padding_id", [0, -1])
def test_nan_past_the_lengths_never_reaches_the_output(dtype, q_lens, seq_lens, padding_id):
    poisoned, clean = poisoned_batch(q_lens, seq_lens, dtype, padding_id)
    assert torch.isnan(poisoned["k_cache"]).any() and torch.isnan(poisoned["v_cache"]).any()
    for attention in (paged_attention_ref, paged_attention):  # the reference, and the CPU path over it
        out = attention(**poisoned, scale=0.3)
        assert torch.isfinite(out).all(), attention.__name__
        assert torch.equal(out, attention(**clean, scale=0.3)), attention.__name__


def test_the_pool_is_not_written():
    poisoned, _ = poisoned_batch([1, 1], [3, 6], torch.float32, 0)
    before = poisoned["k_cache"].clone(), poisoned["v_cache"].clone()
    paged_attention_ref(**poisoned, scale=0.3)
    assert torch.equal(poisoned["k_cache"].isnan(), before[0].isnan())
    assert torch.equal(poisoned["v_cache"].isnan(), before[1].isnan())
