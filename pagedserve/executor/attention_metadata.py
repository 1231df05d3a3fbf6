"""Per-step tensors built once from a StepBatch's columns and shared by every layer."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from pagedserve import kernels
from pagedserve.executor.staging import Staging
from pagedserve.step.step_batch import StepBatch


@dataclass
class AttentionMetadata:
    """All sequences of a step packed into one token dimension of length T.

    input_ids, positions, slot_mapping: int64 [T]; block_tables: int32 [B, max_blocks]
    (padded with 0, past each sequence's blocks); seq_lens: int32 [B], the context length
    including this step's tokens; query_start_loc: int32 [B+1]; sample_indices: int64, the
    packed index of the last token of each sequence that samples, in batch order.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    sample_indices: torch.Tensor
    max_seq_len: int
    # where a piecewise CUDA graph's capture splits (pagedserve.executor.piecewise_graphs): `attend`'s stand-in
    split: Callable | None = None

    def attend(self, q, k_cache, v_cache, scale: float, window: int | None = None, softcap: float | None = None):
        """The paged attention of this step's queries q [T, heads, head_size] over a layer's
        caches (pagedserve.kernels.paged_attention): every model's one way to it."""
        if self.split is not None:
            return self.split(q, k_cache, v_cache, scale, window, softcap)
        return kernels.paged_attention(q, k_cache, v_cache, self.block_tables, self.seq_lens, self.query_start_loc,
                                       scale, window=window, softcap=softcap)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @classmethod
    def from_batch(cls, batch: StepBatch, device: torch.device | str = "cpu",
                   staging: Staging | None = None) -> "AttentionMetadata":
        """The tensors of a StepBatch's columns (pagedserve.executor.seq_screen checks them),
        through `staging` (pinned buffers, non-blocking copies) when given; the fed tokens
        still on the device (StepBatch.device_feed) read there."""
        if not batch.num_seqs:
            raise ValueError("empty StepBatch")
        n = batch.num_tokens
        starts = batch.starts
        if len(n) == len(batch.token_ids):  # one token each: a decode step
            positions = batch.start_pos
        else:
            positions = np.arange(len(batch.token_ids), dtype=np.int64) - np.repeat(starts[:-1] - batch.start_pos, n)
        seq_lens = batch.start_pos + n
        sample = starts[1:][batch.sample] - 1
        staging = staging or Staging(device)
        feed = batch.device_feed
        more = [] if feed is None else [feed[1], feed[2]]
        input_ids, positions, slots, sample, *fed = staging.send(
            [batch.token_ids, positions, batch.slot_mapping, sample, *more], np.int64)
        if feed is not None:  # the tokens the last pass sampled, read where they are
            input_ids[fed[0]] = feed[0][fed[1]]
        tables, lens, starts_t = staging.send([batch.block_tables, seq_lens, starts], np.int32)
        return cls(input_ids=input_ids, positions=positions, slot_mapping=slots, block_tables=tables,
                   seq_lens=lens, query_start_loc=starts_t, sample_indices=sample,
                   max_seq_len=int(seq_lens.max()))
