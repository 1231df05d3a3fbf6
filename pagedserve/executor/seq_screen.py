"""Leave a sequence that cannot run out of its step, so that the others run as they would
alone.

Before a pass each sequence is checked, over the batch's columns at once (`screen`: its
token ids against the vocabulary, its slots and blocks against the pool; its sampling
parameters once, when it is first held). One that fails, or that the executor left out of
an earlier step (`StepBatch.errors` set already, pagedserve.step.running_set), is left out
of the pass and reports an output carrying the reason in its place; the gateway ends its
request alone and tells memsvc its writes did not happen (docs/ARCHITECTURE.md, "One step").
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from pagedserve.step.step_batch import StepBatch
from pagedserve.wire.protocol import SampleOutput
from pagedserve.wire.pending_outputs import PendingOutputs
from pagedserve.wire.step_outputs import StepOutputs

SEQ_FAULTS = (ValueError, IndexError, OverflowError, TypeError, KeyError)


def screen(batch: StepBatch, vocab_size: int | None, num_blocks: int | None, block_size: int | None) -> None:
    """Set `batch.errors[i]` for each sequence whose tokens, slots or blocks are out of range
    (limits that are None are not checked)."""
    row_of_token = None
    if vocab_size is not None and len(batch.token_ids):
        ids = batch.token_ids
        if ids.min() < 0 or ids.max() >= vocab_size:
            row_of_token = np.repeat(np.arange(batch.num_seqs), batch.num_tokens)
            for i in np.unique(row_of_token[(ids < 0) | (ids >= vocab_size)]):
                batch.errors.setdefault(int(i), f"ValueError: sequence {batch.seq_ids[i]}: token ids must be in "
                                                f"[0, {vocab_size})")
    if num_blocks is None or block_size is None or not batch.num_seqs:
        return
    slots = batch.slot_mapping
    if len(slots) and (slots.min() < 0 or slots.max() >= num_blocks * block_size):
        row_of_token = np.repeat(np.arange(batch.num_seqs), batch.num_tokens)
        for i in np.unique(row_of_token[(slots < 0) | (slots >= num_blocks * block_size)]):
            batch.errors.setdefault(int(i), f"ValueError: sequence {batch.seq_ids[i]}: a slot is outside the pool "
                                            f"({num_blocks} blocks of {block_size})")
    tables = batch.block_tables
    if tables.size and (tables.min() < 0 or tables.max() >= num_blocks):
        live = np.arange(tables.shape[1])[None, :] < batch.table_lens[:, None]
        bad = ((tables < 0) | (tables >= num_blocks)) & live
        for i in np.flatnonzero(bad.any(1)):
            batch.errors.setdefault(int(i), f"ValueError: sequence {batch.seq_ids[i]}: block ids must be in "
                                            f"[0, {num_blocks})")


def run_screened(batch: StepBatch, check: Callable[[StepBatch], None],
                 run: Callable[[StepBatch], StepOutputs | PendingOutputs | list[SampleOutput]]
                 ) -> StepOutputs | PendingOutputs:
    """`run(batch)` without the sequences that fail `check` (which sets batch.errors): one
    output per sequence that reports, in batch order, an error output (in `more`, token -1)
    for each one left out. `run`'s pending outputs are waited for only where some are left out."""
    check(batch)
    if not batch.errors:
        out = run(batch)
        return out if isinstance(out, PendingOutputs) else StepOutputs.of(out)
    errors = batch.errors
    reporting = np.flatnonzero(batch.reports()).tolist()
    kept = np.array([i for i in range(batch.num_seqs) if i not in errors], dtype=np.int64)
    ran = run(batch.select(kept)) if len(kept) else ()
    ran = ran.result() if isinstance(ran, PendingOutputs) else StepOutputs.of(ran)
    ran_at = [k for k, i in enumerate(reporting) if i not in errors]  # entry of each of `ran`'s
    if len(ran) != len(ran_at):
        raise RuntimeError(f"the step answered {len(ran)} outputs for the {len(ran_at)} sequences "
                           "left in it that report")
    tokens = [-1] * len(reporting)
    for k, token in zip(ran_at, ran.tokens):
        tokens[k] = token
    more = {ran_at[j]: o for j, o in ran.more.items()}
    for k, i in enumerate(reporting):
        if i in errors:
            more[k] = SampleOutput(batch.seq_ids[i], -1, sampled=False, error=errors[i])
    return StepOutputs([batch.seq_ids[i] for i in reporting], tokens, more)
