"""Leave a sequence that cannot run out of its step, so that the others run as they would
alone.

Before a pass each sequence is checked (`check`: its token ids, slots and blocks against the
model and the pool, its sampling parameters). One that fails, or that the executor left out
of an earlier step (`SeqStep.error` set already, pagedserve.wire.step_feed), is left out of the pass
and reports an output carrying the reason in its place; the gateway ends its request alone
and tells memsvc its writes did not happen (docs/ARCHITECTURE.md, "One step").
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from pagedserve.wire.protocol import SampleOutput, SeqStep, StepBatch

SEQ_FAULTS = (ValueError, IndexError, OverflowError, TypeError, KeyError)


def run_screened(batch: StepBatch, check: Callable[[SeqStep], None],
                 run: Callable[[StepBatch], list[SampleOutput]]) -> list[SampleOutput]:
    """`run(batch)` without the sequences that fail `check`: one output per sequence that
    reports, in batch order, an error output for each one left out."""
    for s in batch.seqs:
        if not s.error:
            try:
                check(s)
            except SEQ_FAULTS as e:
                s.error = f"{type(e).__name__}: {e}"
    if not any(s.error for s in batch.seqs):
        return run(batch)
    kept = [s for s in batch.seqs if not s.error]
    outputs = iter(run(dataclasses.replace(batch, seqs=kept)) if kept else ())
    return [SampleOutput(s.seq_id, -1, sampled=False, error=s.error) if s.error else next(outputs)
            for s in batch.seqs if s.reports]
