"""The decode kernel's split count (kernels/paged_attention_triton.choose_splits) at the
shapes timed on an H200 (132 SMs; docs/benchmark-history.md, "On one H200"): each
choice is the measured best or within a few percent of it."""
import importlib.util

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

H200_SMS = 132


def programs(seqs: int, heads: int, kv_heads: int, block_size: int, head_size: int) -> int:
    from pagedserve.kernels.paged_attention_triton import launch_config

    cfg = launch_config(seqs, seqs, heads // kv_heads, block_size, head_size)
    return (seqs // cfg["block_q"] + seqs) * kv_heads


@pytest.mark.parametrize("seqs, context, head, splits", [
    (256, 2048, 128, 1), (128, 2048, 128, 1), (64, 2048, 128, 1),  # enough programs: splitting cost 3-45%
    (32, 8192, 128, 4), (16, 4096, 128, 7), (32, 2048, 64, 4),
    (8, 8192, 128, 14), (4, 8192, 128, 16),  # bounded by the context: 16 splits of 512 tokens
    (1, 32768, 128, 64),  # bounded by MAX_SPLITS
])
def test_decode_batches_split_as_measured(seqs, context, head, splits):
    from pagedserve.kernels.paged_attention_triton import choose_splits

    assert choose_splits(programs(seqs, 32, 8, 16, head), context, True, H200_SMS) == splits


def test_batches_with_prefill_rows_and_short_contexts_never_split():
    from pagedserve.kernels.paged_attention_triton import (
        MIN_SPLIT_TOKENS,
        choose_splits,
    )

    assert choose_splits(8, 32768, False, H200_SMS) == 1
    assert choose_splits(8, MIN_SPLIT_TOKENS - 1, True, H200_SMS) == 1
