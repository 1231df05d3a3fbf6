"""What one step did to a sequence (`SeqUpdate`): a row of the step's updates
(pagedserve.gateway.step_updates) kept whole where it carries more than its token (logprobs,
the sequence ended or failed); the loop's requests turn rows into deltas
(pagedserve.gateway.requests). See docs/ARCHITECTURE.md, "One step"."""
from __future__ import annotations

from dataclasses import dataclass

from pagedserve.gateway.sequence import Sequence
from pagedserve.wire.protocol import PromptLogprob


@dataclass(slots=True)
class SeqUpdate:
    """What one step did to a sequence: a new token, and whether it finished."""

    seq: Sequence
    token_id: int | None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finished: bool = False
    prompt_logprobs: list[PromptLogprob] | None = None  # with the first token, when asked
    error: str | None = None  # the sequence failed alone, for this reason: its request ends
