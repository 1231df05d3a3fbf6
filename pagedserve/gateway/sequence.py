"""A sequence as the gateway tracks it: tokens, progress through the cache, and why it ended."""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field

from pagedserve.wire.protocol import PromptLogprob, SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # not in memsvc (new, or preempted for recompute)
    RUNNING = "running"  # memsvc holds its blocks on the device
    SWAPPED = "swapped"  # memsvc holds its blocks in the host swap space; nothing to recompute
    FINISHED = "finished"


@dataclass(eq=False, slots=True)  # one object per sequence: queues find and remove it by identity
class Sequence:
    seq_id: str
    request_id: str
    index: int  # which of the request's n completions
    prompt_token_ids: list[int]
    sampling: SamplingParams
    seed: int
    max_len: int  # prompt + max_tokens, capped at the model maximum
    arrival: float
    priority: int = 0  # lower runs first
    final_len: int | None = None  # measurement hint only
    salt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = -1  # prefix-cache hit at first admission; -1 until admitted
    num_preemptions: int = 0
    fork_at: int | None = None  # n > 1: compute only this far, then fork the other samples
    finish_reason: str | None = None
    error: str | None = None
    # prompt logprobs (sampling.prompt_logprobs) of prompt positions 1.. so far; None: not asked
    prompt_logprobs: list[PromptLogprob] | None = None

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("a sequence needs at least one prompt token")
        if self.prompt_logprobs is None and self.sampling.prompt_logprobs is not None:
            self.prompt_logprobs = []

    def add_prompt_logprobs(self, first: int, entries: list[PromptLogprob]) -> None:
        """Entries of prompt positions first..; those already held (a recompute) are skipped."""
        have = len(self.prompt_logprobs) + 1
        if first <= have < first + len(entries):
            self.prompt_logprobs.extend(entries[have - first:])

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def tokens_left(self) -> int:
        """Tokens it may take before its length ends it (`sampling.max_tokens`, `max_len`)."""
        return min(self.sampling.max_tokens - len(self.output_token_ids), self.max_len - self.num_tokens)

    @property
    def compute_limit(self) -> int:
        """Tokens to have in the cache before the next sample (the fork point, while one is due)."""
        return self.num_tokens if self.fork_at is None else self.fork_at

    def fork(self, seq_id: str, index: int) -> Sequence:
        """A running copy sharing this one's cache state under a new id (memsvc forks the blocks)."""
        return dataclasses.replace(
            self, seq_id=seq_id, index=index, prompt_token_ids=self.prompt_token_ids,
            output_token_ids=list(self.output_token_ids), status=SeqStatus.RUNNING, num_preemptions=0,
            fork_at=None,
        )

    @property
    def sort_key(self) -> tuple[int, float, int]:
        return (self.priority, self.arrival, self.index)

    def finish(self, reason: str, error: str | None = None) -> None:
        self.status = SeqStatus.FINISHED
        self.finish_reason = reason
        self.error = error
