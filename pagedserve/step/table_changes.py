"""A step's changes to the block tables of the running set (pagedserve.step.running_set): from
`table_start[i]` on, row i's table is its `num_new_blocks[i]` blocks of `new_blocks`. Checked
whole before any change, made in one scatter. Every change to the running set's `tables` or
`table_len` (here and in pagedserve.step.running_rows) counts in its `tables_version`, which
tells a StepRows whether the tables it holds are current.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from pagedserve.step import running_rows

if TYPE_CHECKING:
    from pagedserve.step.running_set import RunningSet


def changes(lens: np.ndarray, tstart: np.ndarray, nnew: np.ndarray, new_blocks) -> bool:
    """Whether the step changes a table (`lens`: the rows' table lengths before it)."""
    return bool(len(new_blocks) or nnew.any() or np.count_nonzero(tstart != lens))


def change(rs: RunningSet, ids: list[str], rows: np.ndarray, tstart: np.ndarray, nnew: np.ndarray,
           new_blocks) -> None:
    """Change the tables of `rows` as the step says. ValueError, before any change, for a
    change that does not fit."""
    if nnew.sum() != len(new_blocks):
        raise ValueError("token_ids or new_blocks do not add up to the per-sequence counts")
    changed = np.flatnonzero((nnew > 0) | (tstart != rs.table_len[rows]))
    if not len(changed):
        return
    r, ts, k = rows[changed], tstart[changed], nnew[changed]
    old = rs.table_len[r]
    bad = np.flatnonzero(ts > old)
    if len(bad):
        i = bad[0]
        raise ValueError(f"sequence {ids[changed[i]]}: block table change at {ts[i]}, "
                         f"but it holds {old[i]} blocks")
    if len(set(r.tolist())) < len(r):
        twice = next(ids[i] for i in changed if (r == rows[i]).sum() > 1)
        raise ValueError(f"sequence {twice}: twice in one step that changes its block table")
    end = ts + k
    rs.tables_version += 1
    top = int(end.max())
    if top > rs.tables.shape[1]:
        running_rows.grow(rs, width=max(top, 2 * rs.tables.shape[1]))
    if len(new_blocks):
        first = np.cumsum(k) - k
        rs.tables[np.repeat(r, k), np.arange(len(new_blocks)) - np.repeat(first - ts, k)] = new_blocks
    for i in np.flatnonzero(end < old):  # cut back (recompute)
        rs.tables[r[i], end[i]:old[i]] = 0
    rs.table_len[r] = end
