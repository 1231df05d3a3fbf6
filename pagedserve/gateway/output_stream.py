"""Turns one sequence's sampled tokens into client-visible text: detokenize, then apply stop
strings, from the token after the first `min_tokens` on (as vLLM: the text of those tokens
is never searched). Without stop strings a stream's `add` is its detokenizer's."""
from __future__ import annotations

from pagedserve.gateway.byte_detokenizer import ByteDetokenizer
from pagedserve.gateway.byte_tables import byte_tables
from pagedserve.gateway.detokenizer import IncrementalDetokenizer
from pagedserve.gateway.stop_strings import StopStringFilter


class OutputStream:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str], min_tokens: int = 0):
        self.detok = None
        if tokenizer:
            tables = byte_tables(tokenizer)
            self.detok = (ByteDetokenizer(tables[0], prompt_token_ids, tables[1]) if tables is not None
                          else IncrementalDetokenizer(tokenizer, prompt_token_ids))
        self.stop = StopStringFilter(stop)
        self.min_tokens, self.tokens = min_tokens, 0
        self.stopped = False  # a stop string appeared
        if self.detok is not None and not self.stop.stop:  # nothing to hold back or search
            self.add = self.detok.add

    def add(self, token_id: int) -> str:
        if self.detok is None:
            return ""
        self.tokens += 1
        text = self.detok.add(token_id)
        if self.tokens <= self.min_tokens:
            return self.stop.flush() + text
        text = self.stop.feed(text)
        self.stopped = self.stop.stopped
        return text

    def flush(self) -> str:
        return self.stop.flush()
