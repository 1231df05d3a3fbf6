"""Turns one sequence's sampled tokens into client-visible text: detokenize, then apply stop strings."""
from __future__ import annotations

from gateway.byte_detokenizer import ByteDetokenizer, byte_table
from gateway.detokenizer import IncrementalDetokenizer
from gateway.stop_strings import StopStringFilter


class OutputStream:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str]):
        self.detok = None
        if tokenizer:
            table = byte_table(tokenizer)
            self.detok = (ByteDetokenizer(table, prompt_token_ids) if table is not None
                          else IncrementalDetokenizer(tokenizer, prompt_token_ids))
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
