"""Who holds a row of the running set (pagedserve.step.running_set): a sequence taken in
(`admit`: its constant state checked once, its sampling parameters as columns), let go
(`forget`), and the arrays grown when rows or table width run out. A step's own changes
are the running set's. See docs/ARCHITECTURE.md, "One step".
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from pagedserve.step.step_batch import (FLAG_GUIDED, FLAG_HISTORY, FLAG_INVALID, FLAG_PLAIN,
                                        FLAG_PROMPT_LOGPROBS, Held)

if TYPE_CHECKING:
    from pagedserve.step.running_set import RunningSet


def flags_of(sp) -> int:
    plain = (sp.greedy and not sp.uses_penalties and sp.logprobs is None and not sp.logit_bias
             and sp.top_k <= 0 and sp.top_p >= 1 and sp.min_p <= 0)
    return ((FLAG_PLAIN if plain else 0) | (FLAG_HISTORY if sp.uses_penalties else 0)
            | (FLAG_PROMPT_LOGPROBS if sp.prompt_logprobs is not None else 0)
            | (FLAG_GUIDED if sp.guided else 0))


def columns_of(sp) -> tuple[float, int, float, float]:
    """The sampler's columns for one sequence: temperature (1 when greedy), top_k, top_p, min_p."""
    return 1.0 if sp.greedy else sp.temperature, sp.top_k, sp.top_p, sp.min_p


def grow(rs: RunningSet, rows: int = 0, width: int = 0) -> None:
    """Room for at least `rows` rows and `width` blocks a table."""
    old_rows, old_width = rs.tables.shape
    rows, width = max(rows, old_rows), max(width, old_width)
    rs.tables_version += 1
    if width > old_width:
        t = np.zeros((old_rows, width), dtype=np.int32)
        t[:, :old_width] = rs.tables
        rs.tables = t
    if rows > old_rows:
        rs._last = None
        extra = rows - old_rows
        rs.tables = np.concatenate([rs.tables, np.zeros((extra, width), dtype=np.int32)])
        for name, fill in (("table_len", 0), ("last_pos", -1), ("last_token", 0), ("feed_src", -1), ("gen", 0),
                           ("flags", 0), ("temperature", 1), ("top_k", 0), ("top_p", 1), ("min_p", 0)):
            a = getattr(rs, name)
            setattr(rs, name, np.concatenate([a, np.full(extra, fill, dtype=a.dtype)]))
        rs.held += [None] * extra
        rs.free = list(range(rows - 1, old_rows - 1, -1)) + rs.free


def admit(rs: RunningSet, seq_id: str, sampling, seed: int, prompt_len: int = 0, history: list[int] | None = None,
          prompt: list[int] | None = None, table: list[int] | None = None) -> int:
    """Hold a sequence (again: its state and table replaced, its last sample kept)."""
    rs._last = None
    r = rs.row_of.get(seq_id)
    if r is None:
        if not rs.free:
            grow(rs, rows=2 * len(rs.held))
        r = rs.row_of[seq_id] = rs.free.pop()
        rs._owners += 1
        rs._gen += 1
        rs.gen[r] = rs._gen
        rs.last_pos[r] = -1
        rs.feed_src[r] = -1
    if sampling is not rs._checked[0]:  # the sequences of one request share theirs
        try:
            sampling.validate()
            rs._checked = (sampling, flags_of(sampling), "")
        except (ValueError, TypeError, OverflowError) as e:  # it is left out of every step, alone
            rs._checked = (sampling, FLAG_INVALID, f"{type(e).__name__}: {e}")
    _, flags, error = rs._checked
    rs.held[r] = Held(seq_id, sampling, seed, prompt_len if flags & FLAG_HISTORY else 0,
                        history if flags & FLAG_HISTORY else None,
                        list(prompt) if flags & FLAG_PROMPT_LOGPROBS else None, flags, error)
    rs.flags[r] = flags
    if not error:
        rs.temperature[r], rs.top_k[r], rs.top_p[r], rs.min_p[r] = columns_of(sampling)
    rs.table_len[r] = 0
    rs.tables_version += 1
    if table:
        set_table(rs, r, 0, table)
    return r


def forget(rs: RunningSet, seq_ids) -> None:
    for seq_id in seq_ids:
        r = rs.row_of.pop(seq_id, None)
        rs.left_out.pop(seq_id, None)
        if r is not None:
            rs._last = None
            rs._owners += 1
            rs.held[r] = None
            rs.table_len[r] = 0
            rs.tables_version += 1
            rs.free.append(r)


def set_table(rs: RunningSet, r: int, start: int, blocks) -> None:
    end = start + len(blocks)
    if end > rs.tables.shape[1]:
        grow(rs, width=max(end, 2 * rs.tables.shape[1]))
    old = rs.table_len[r]
    rs.tables_version += 1
    rs.tables[r, start:end] = blocks
    if end < old:
        rs.tables[r, end:old] = 0
    rs.table_len[r] = end
