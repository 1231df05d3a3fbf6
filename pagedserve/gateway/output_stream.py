"""Turns one sequence's sampled tokens into client-visible text: detokenize, then apply stop
strings, from the token after the first `min_tokens` on (as vLLM: the text of those tokens
is never searched)."""
from __future__ import annotations

from pagedserve.gateway.byte_detokenizer import ByteDetokenizer, byte_table
from pagedserve.gateway.detokenizer import IncrementalDetokenizer
from pagedserve.gateway.stop_strings import StopStringFilter


class OutputStream:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str], min_tokens: int = 0):
        self.detok = None
        if tokenizer:
            table = byte_table(tokenizer)
            self.detok = (ByteDetokenizer(table, prompt_token_ids) if table is not None
                          else IncrementalDetokenizer(tokenizer, prompt_token_ids))
        self.stop = StopStringFilter(stop)
        self.min_tokens, self.tokens = min_tokens, 0

    def add(self, token_id: int) -> str:
        if self.detok is None:
            return ""
        self.tokens += 1
        text = self.detok.add(token_id)
        if self.tokens <= self.min_tokens:
            return self.stop.flush() + text
        return self.stop.feed(text)

    @property
    def stopped(self) -> bool:
        return self.stop.stopped

    def flush(self) -> str:
        return self.stop.flush()
