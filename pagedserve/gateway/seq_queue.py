"""The scheduler's queues (waiting, running, swapped) are lists kept in `Sequence.sort_key`
order (priority, then arrival): `insert` puts a sequence in its place. A plan walks them in
that order. See docs/ARCHITECTURE.md, "One step"."""
from __future__ import annotations

import bisect

from pagedserve.gateway.sequence import Sequence


def insert(queue: list[Sequence], seq: Sequence) -> None:
    """After those with its key or a lower one (as bisect.insort); at the end without a
    search where none is higher (sequences mostly come in order)."""
    if not queue or queue[-1].sort_key <= seq.sort_key:
        queue.append(seq)
    else:
        bisect.insort(queue, seq, key=lambda s: s.sort_key)
