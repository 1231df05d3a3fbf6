"""What one step reported, in columns: one entry per row that reports (it samples, or
scores prompt tokens), in batch order (pagedserve.step.step_batch.StepBatch.reports).

`seq_ids[k]` and `tokens[k]` are entry k's sequence and sampled token; an entry that carries
more than that (logprobs, prompt logprobs, an error, a prompt chunk that samples nothing)
is the SampleOutput `more[k]`, its token in `tokens` too (-1 where it sampled none). A
steady step has no `more`: the executor, the wire and the gateway read the two columns.
Indexing or iterating gives each entry as a SampleOutput (made on demand), for the code
that reads one sequence at a time. See docs/ARCHITECTURE.md, "One step".
"""
from __future__ import annotations

from typing import Iterable

from pagedserve.wire.protocol import SampleOutput


class StepOutputs:
    __slots__ = ("seq_ids", "tokens", "more")

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

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, k: int) -> SampleOutput:
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        out = self.more.get(k if k >= 0 else k + len(self))
        return out if out is not None else SampleOutput(self.seq_ids[k], self.tokens[k])

    def __iter__(self):
        more = self.more
        if not more:
            return map(SampleOutput, self.seq_ids, self.tokens)
        return (more.get(k) or SampleOutput(s, t) for k, (s, t) in enumerate(zip(self.seq_ids, self.tokens)))

    def __eq__(self, other) -> bool:
        if isinstance(other, (StepOutputs, list, tuple)):
            return list(self) == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"StepOutputs({list(self)!r})"

    def errors(self) -> dict[int, str]:
        """Entry -> why the executor left its sequence out of the step."""
        return {k: o.error for k, o in self.more.items() if o.error}
