"""Any step's columns applied to the running set (pagedserve.step.running_set: this is its
own code, split out): prompt chunks, mixed steps, fed and known tokens; the reference a
steady decode step's `RunningSet.apply_decode` is tested against. docs/ARCHITECTURE.md,
"One step".
"""
from __future__ import annotations

import numpy as np

from pagedserve.step import table_changes
from pagedserve.wire.pending_token import PENDING


def apply(running, seq_ids: list[str], start_pos, num_tokens, tokens, fed, sample, table_start,
          num_new_blocks, new_blocks, **batch_fields):
    """The StepBatch of one step's columns; its table changes applied. `tokens`: the
    tokens of the sequences not `fed` (bool [B], or None: none is), in order; a fed
    sequence computes one token, PENDING until `fill`. `batch_fields`: the StepBatch's
    pool_epoch, forget, step, copies. StateLost for an unknown id;
    ValueError for a change that does not fit."""
    n = np.asarray(num_tokens, dtype=np.int64)
    fed = np.asarray(fed, dtype=bool) if fed is not None and len(fed) else None
    ids, at, start, tstart, nnew = running._columns(seq_ids, start_pos, table_start, num_new_blocks,
                                                    n if fed is None else (n, fed))
    rows, b = at.rows, len(ids)
    if b and (n.min() < 1 or start.min() < 0):
        i = int(np.flatnonzero((n < 1) | (start < 0))[0])
        raise ValueError(f"sequence {ids[i]}: {n[i]} tokens at position {start[i]}: "
                         "a step computes at least one token at a position >= 0")
    lens = running.table_len[rows]
    if table_changes.changes(lens, tstart, nnew, new_blocks):
        table_changes.change(running, ids, rows, tstart, nnew, new_blocks)
        lens = running.table_len[rows]
    total = int(n.sum())
    decode = total == b  # one token each (n >= 1)
    fed_i = fed.nonzero()[0] if fed is not None else np.zeros(0, dtype=np.int64)
    if len(fed_i) and not decode and (n[fed_i] != 1).any():
        i = int(fed_i[n[fed_i] != 1][0])
        raise ValueError(f"sequence {ids[i]}: a fed step computes one token, not {n[i]}")
    if total - len(fed_i) != len(tokens):
        raise ValueError("token_ids or new_blocks do not add up to the per-sequence counts")
    token_ids = np.empty(total, dtype=np.int64)
    token_ids.fill(PENDING)
    first = None if decode else np.cumsum(n) - n
    if len(fed_i) < total:
        if len(fed_i):
            known = np.ones(total, dtype=bool)
            known[fed_i if decode else first[fed_i]] = False
            token_ids[known] = tokens
        else:
            token_ids[:] = tokens
    if decode:
        slots = running._decode_slots(ids, rows, start, lens)
    else:
        bs = running.block_size
        token_rows = np.repeat(rows, n)
        index, slots = np.divmod(np.arange(total, dtype=np.int64) - np.repeat(first - start, n), bs)
        short = index >= running.table_len[token_rows]
        if short.any():
            i = int(np.searchsorted(np.cumsum(n), int(np.flatnonzero(short)[0]), side="right"))
            running._short(ids, i, lens, int(start[i] + n[i]))
        slots += running.tables[token_rows, index] * np.int64(bs)
    tables = running.tables[rows, :int(lens.max()) if b else 0]
    return running._applied(ids, at, start, n, token_ids, np.asarray(sample, dtype=bool), slots, tables, lens,
                            fed_i, batch_fields)
