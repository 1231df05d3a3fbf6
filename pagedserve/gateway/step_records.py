"""What one phase of the scheduler's step leaves for a later one: `Planned` (a plan made ahead,
for `on_reserved` to apply the answer to it) and `Took` (what `on_sampled` applied, for the
next plan made ahead and the next `on_sampled`: pagedserve.gateway.steady_decode). Each is
current while `Scheduler.removals` stays what it was when it was made. See
docs/ARCHITECTURE.md, "The step path"."""
from __future__ import annotations

from dataclasses import dataclass

from pagedserve.gateway.sequence import Sequence
from pagedserve.wire.step_delta import StepDelta


@dataclass
class Took:
    """What `on_sampled` leaves where each sequence of its batch took a plain token (no
    error, fork point, prompt logprobs or beam search) and none ended: the batch's
    sequences, in its order, the tokens they took, how many tokens each holds now, the
    fewest tokens any of them may still take before its length ends it, the tokens that
    stop each, `stop_any`, every one of those stop tokens (a step whose tokens are none of
    them stops none), `held`, how many each held before (where the tokens taken are: a plan
    made ahead reads where they end, without adding), and the sequences' ids. The
    next plan made ahead and the next `on_sampled` read it while their batch's sequences
    are these (only `on_sampled` adds their tokens)."""

    seqs: list[Sequence]
    tokens: list[int]
    num_tokens: list[int]
    left: int
    stops: list[frozenset[int]]
    removals: int  # Scheduler.removals then: while it stays, the sequences are current
    stop_any: frozenset[int]  # every token of `stops` (or more)
    held: list[int]  # num_tokens less one each
    ids: list[str]  # the ids of `seqs`: the same str objects from step to step


@dataclass
class Planned:
    """A plan made ahead of `ahead_of`, for the answer to it: its ids and their sequences
    then, in plan order (a sequence may end, or its id be reused by a new request, before
    the answer is applied); where its running part was a steady decode step
    (`Scheduler._steady_run`), the positions `ahead_of`'s tokens end at, in the same order."""

    ids: list[str]
    seqs: list[Sequence]
    ahead_of: StepDelta
    fed_ends: list[int] | None
    removals: int  # Scheduler.removals then: while it stays, `seqs` are current
