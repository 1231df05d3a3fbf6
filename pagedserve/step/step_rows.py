"""The rows of one step's sequences in the running set (pagedserve.step.running_set) and what
they hold: the running set hands the same StepRows to each step that names the same ids, in
the same order, until a row changes hands, so a steady step looks up no id and gathers no
sampling column (nor, while no table changes, its tables).
"""
from __future__ import annotations

import numpy as np


class StepRows:
    """The rows of one step's ids and what they hold (read-only arrays): the running set
    hands the same to each step that names the same ids, until a row changes."""

    __slots__ = ("ids", "rows", "held", "flags", "some", "temperature", "top_k", "top_p", "min_p", "gen",
                 "_decode", "_tables")

    def __init__(self, running, ids: list[str], rows: list[int]):
        self.ids = ids
        self.rows = np.array(rows, dtype=np.int64)
        self.held = list(map(running.held.__getitem__, rows))
        for name in ("flags", "temperature", "top_k", "top_p", "min_p", "gen"):
            setattr(self, name, getattr(running, name)[self.rows])
        for a in (self.rows, self.flags, self.temperature, self.top_k, self.top_p, self.min_p, self.gen):
            a.flags.writeable = False
        self.some = int(np.bitwise_or.reduce(self.flags)) if len(rows) else 0  # every row's flags
        self._decode = None
        self._tables = None

    def decode_columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A decode step's num_tokens (all 1), sample (all True) and fed rows (every one), made once."""
        if self._decode is None:
            b = len(self.ids)
            self._decode = (np.ones(b, dtype=np.int64), np.ones(b, dtype=bool), np.arange(b, dtype=np.int64))
            for a in self._decode:
                a.flags.writeable = False
        return self._decode

    def tables(self, running) -> tuple[np.ndarray, np.ndarray]:
        """The rows' table lengths and their block tables up to the longest (read only), as
        the running set holds them: made again once a table changed (`tables_version`)."""
        if self._tables is None or self._tables[0] != running.tables_version:
            lens = running.table_len[self.rows]
            tables = running.tables[self.rows, :int(lens.max()) if len(lens) else 0]
            lens.flags.writeable = tables.flags.writeable = False
            self._tables = (running.tables_version, lens, tables)
        return self._tables[1], self._tables[2]
