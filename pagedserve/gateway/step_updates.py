"""What one step did to its sequences, in columns (`StepUpdates`): row k, sequence `seqs[k]`
took token `tokens[k]`. A row that carries more (logprobs, its sequence ended or failed
alone, a beam search's step) is `more[k]`, a SeqUpdate (or BeamDone, with None in both
columns). A steady decode step has no `more`: `Scheduler.on_sampled` writes the two columns
and `Requests.deltas` reads them in one loop. Indexing or iterating gives each row as a
SeqUpdate (made on demand: pagedserve.wire.column_rows), for the code that reads one at a time. See
docs/ARCHITECTURE.md, "One step".
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from pagedserve.gateway.seq_update import SeqUpdate
from pagedserve.gateway.sequence import Sequence
from pagedserve.wire.column_rows import ColumnRows

if TYPE_CHECKING:
    from pagedserve.gateway.beam_search import BeamDone


class StepUpdates(ColumnRows):
    __slots__ = ("more", "seqs", "tokens")
    row = SeqUpdate

    def __init__(self, seqs: list[Sequence | None] | None = None, tokens: list[int | None] | None = None,
                 more: dict[int, SeqUpdate | BeamDone] | None = None):
        self.seqs = [] if seqs is None else seqs
        self.tokens = [] if tokens is None else tokens
        if len(self.seqs) != len(self.tokens):
            raise ValueError(f"{len(self.seqs)} sequences but {len(self.tokens)} tokens")
        self.more = {} if more is None else more

    def add(self, seq: Sequence, token: int, logprob: float | None = None,
            top_logprobs: list[tuple[int, float]] | None = None, finished: bool = False,
            prompt_logprobs: list | None = None) -> None:
        """A row: `seq` took `token`, with the rest where given."""
        self.seqs.append(seq)
        self.tokens.append(token)
        self.carry(len(self.tokens) - 1, logprob, top_logprobs, finished, prompt_logprobs)

    def carry(self, k: int, logprob: float | None = None, top_logprobs: list[tuple[int, float]] | None = None,
              finished: bool = False, prompt_logprobs: list | None = None) -> None:
        """Row k carries these too (nothing kept where none is given: a plain token)."""
        if logprob is not None or top_logprobs or finished or prompt_logprobs:
            self.more[k] = SeqUpdate(self.seqs[k], self.tokens[k], logprob, top_logprobs, finished,
                                     prompt_logprobs)

    def append(self, update: SeqUpdate | BeamDone) -> None:
        """A row given whole."""
        self.more[len(self.tokens)] = update
        whole = update.__class__ is SeqUpdate
        self.seqs.append(update.seq if whole else None)
        self.tokens.append(update.token_id if whole else None)

    def extend(self, updates: Iterable[SeqUpdate | BeamDone]) -> None:
        for update in updates:
            self.append(update)

    def _columns(self) -> tuple[list[Sequence | None], list[int | None]]:
        return self.seqs, self.tokens
