"""What one step reported, in columns: one entry per row that reports (it samples, or
scores prompt tokens), in batch order (pagedserve.step.step_batch.StepBatch.reports).

`seq_ids[k]` and `tokens[k]` are entry k's sequence and sampled token; an entry that carries
more than that (logprobs, prompt logprobs, an error, a prompt chunk that samples nothing)
is the SampleOutput `more[k]`, its token in `tokens` too (-1 where it sampled none). A
steady step has no `more`: the executor, the wire and the gateway read the two columns.
Indexing or iterating gives each entry as a SampleOutput (made on demand:
pagedserve.wire.column_rows), for the code that reads one sequence at a time. See
docs/ARCHITECTURE.md, "One step".
"""
from __future__ import annotations

from typing import Iterable

from pagedserve.wire.column_rows import ColumnRows
from pagedserve.wire.protocol import SampleOutput


class StepOutputs(ColumnRows):
    __slots__ = ("more", "seq_ids", "tokens")
    row = SampleOutput

    def __init__(self, seq_ids: list[str], tokens: list[int], more: dict[int, SampleOutput] | None = None):
        if len(seq_ids) != len(tokens):
            raise ValueError(f"{len(seq_ids)} sequence ids but {len(tokens)} tokens")
        self.seq_ids, self.tokens, self.more = seq_ids, tokens, more or {}

    @classmethod
    def of(cls, outputs: StepOutputs | Iterable[SampleOutput]) -> StepOutputs:
        """`outputs` in columns (as they are, when they already are)."""
        if isinstance(outputs, StepOutputs):
            return outputs
        outputs = list(outputs)
        more = {k: o for k, o in enumerate(outputs)
                if o.logprob is not None or o.top_logprobs or not o.sampled or o.prompt_logprobs or o.error}
        return cls([o.seq_id for o in outputs], [o.token_id for o in outputs], more)

    def _columns(self) -> tuple[list[str], list[int]]:
        return self.seq_ids, self.tokens

    def put(self, k: int, out: SampleOutput) -> None:
        """Entry k is `out`, whole (its token in the column too)."""
        self.tokens[k] = out.token_id
        self.more[k] = out

    def part(self, start: int, stop: int) -> StepOutputs:
        """Entries start..stop-1, numbered from 0."""
        more = {k - start: o for k, o in self.more.items() if start <= k < stop} if self.more else None
        return StepOutputs(self.seq_ids[start:stop], self.tokens[start:stop], more)

    def errors(self) -> dict[int, str]:
        """Entry -> why the executor left its sequence out of the step."""
        return {k: o.error for k, o in self.more.items() if o.error}
