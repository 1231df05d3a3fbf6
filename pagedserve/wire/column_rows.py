"""Rows kept as columns: most rows are plain (two columns say all of them), the few that carry
more are kept whole in `more` (row index -> the row). Indexing or iterating gives every row
whole, made on demand for a plain one, for the code that reads one row at a time; the same
rows compare equal, as a list too. pagedserve.wire.step_outputs (a step's outputs) and
pagedserve.gateway.step_updates (what a step did to its sequences) are such rows.
"""
from __future__ import annotations


class ColumnRows:
    """A subclass sets `row` (the class of a whole row, made from the two columns' values)
    and `_columns` (the two columns)."""

    __slots__ = ()
    row: type

    def _columns(self) -> tuple[list, list]:
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self._columns()[1])

    def __getitem__(self, k):
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        if k < 0:
            k += len(self)
        whole = self.more.get(k)
        if whole is not None:
            return whole
        a, b = self._columns()
        return self.row(a[k], b[k])

    def __iter__(self):
        (a, b), more, row = self._columns(), self.more, self.row
        if not more:
            return map(row, a, b)
        return (more.get(k) or row(x, y) for k, (x, y) in enumerate(zip(a, b)))

    def __eq__(self, other) -> bool:
        if isinstance(other, (ColumnRows, list, tuple)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({list(self)!r})"
