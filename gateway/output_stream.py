"""Turns one sequence's sampled tokens into client-visible text: detokenize, then apply stop strings."""
from __future__ import annotations

from dataclasses import dataclass, field

from gateway.detokenizer import IncrementalDetokenizer
from gateway.stop_strings import StopStringFilter


@dataclass
class Delta:
    """New output of one completion since the last delta."""

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None


class OutputStream:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str]):
        self.detok = IncrementalDetokenizer(tokenizer, prompt_token_ids) if tokenizer else None
        self.stop = StopStringFilter(stop)

    def add(self, token_id: int) -> str:
        if self.detok is None:
            return ""
        return self.stop.feed(self.detok.add(token_id))

    @property
    def stopped(self) -> bool:
        return self.stop.stopped

    def flush(self) -> str:
        return self.stop.flush()
