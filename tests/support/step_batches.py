"""Two StepBatches compared field by field: arrays by value and dtype, each Held by the
fields named, and (`histories_as_read`) the histories as a rank reads them, through
prompt_of and output_of, rather than as held."""
from __future__ import annotations

import dataclasses

import numpy as np

from pagedserve.step.step_batch import StepBatch


def assert_same_batch(a: StepBatch, b: StepBatch, held: tuple[str, ...], histories_as_read: bool = False) -> None:
    for f in dataclasses.fields(StepBatch):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name == "_starts":
            continue
        if f.name == "held":
            assert [[getattr(h, k) for k in held] for h in x] == [[getattr(h, k) for k in held] for h in y]
        elif f.name == "histories" and histories_as_read:
            assert set(x) == set(y)
            assert [(a.prompt_of(i), a.output_of(i)) for i in range(a.num_seqs)] == \
                [(b.prompt_of(i), b.output_of(i)) for i in range(b.num_seqs)]
        elif isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and np.array_equal(x, y), f.name
        else:
            assert x == y, f.name
