"""A StepBatch taken apart and put together: the batch of some of its rows (`select`, the
screen runs the rows it keeps) and one batch of several callers' (`concat`, the step
merger's pass). See docs/ARCHITECTURE.md, "One step".
"""
from __future__ import annotations

import numpy as np

from pagedserve.step.step_batch import StepBatch


def select(self: StepBatch, rows: np.ndarray) -> StepBatch:
    """The batch of `rows` (int indices, in order), without errors, forgets or copies'
    repetition: those stay with this batch. Its fed tokens are the host's (no device feed)."""
    if self.device_feed is not None:
        raise ValueError("a batch whose fed tokens are on the device is selected from only once they are read")
    starts = self.starts
    n = self.num_tokens[rows]
    token_rows = np.repeat(rows, n)
    within = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
    at = starts[token_rows] + within
    lens = self.table_lens[rows]
    width = int(lens.max()) if len(rows) else 0
    index = {int(r): k for k, r in enumerate(rows)}
    return StepBatch(
        [self.seq_ids[r] for r in rows], self.start_pos[rows], n, self.token_ids[at], self.sample[rows],
        self.slot_mapping[at], self.block_tables[rows, :width], lens, [self.held[r] for r in rows],
        self.flags[rows], *(None if c is None else c[rows] for c in self.columns()),
        histories={index[r]: h for r, h in self.histories.items() if r in index},
        pool_epoch=self.pool_epoch, forget=self.forget, step=self.step, copies=self.copies)


def concat(batches: list[StepBatch]) -> StepBatch:
    """One batch of several callers' (their sequences in order; forgets, copies and device
    feeds joined: these read one pass's tokens, the one pass in flight)."""
    if len(batches) == 1:
        return batches[0]
    feeds, offset = [], 0
    for b in batches:
        if b.device_feed is not None:
            feeds.append((b.device_feed[0], b.device_feed[1] + offset, b.device_feed[2]))
        offset += len(b.token_ids)
    if len({id(f[0]) for f in feeds}) > 1:
        raise ValueError("the merged steps read fed tokens from different passes")
    feed = (feeds[0][0], np.concatenate([f[1] for f in feeds]), np.concatenate([f[2] for f in feeds])) if feeds \
        else None
    width = max((b.block_tables.shape[1] for b in batches), default=0)
    tables = np.zeros((sum(b.num_seqs for b in batches), width), dtype=np.int32)
    at, histories, errors = 0, {}, {}
    for b in batches:
        tables[at:at + b.num_seqs, :b.block_tables.shape[1]] = b.block_tables
        histories.update({at + r: h for r, h in b.histories.items()})
        errors.update({at + r: e for r, e in b.errors.items()})
        at += b.num_seqs
    return StepBatch(
        [s for b in batches for s in b.seq_ids], np.concatenate([b.start_pos for b in batches]),
        np.concatenate([b.num_tokens for b in batches]), np.concatenate([b.token_ids for b in batches]),
        np.concatenate([b.sample for b in batches]), np.concatenate([b.slot_mapping for b in batches]),
        tables, np.concatenate([b.table_lens for b in batches]), [h for b in batches for h in b.held],
        np.concatenate([b.flags for b in batches]),
        *(np.concatenate([b.columns()[k] for b in batches]) for k in range(4)), histories, errors,
        forget=[f for b in batches for f in b.forget], copies=[c for b in batches for c in b.copies],
        device_feed=feed)
