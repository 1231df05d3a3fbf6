"""Incremental detokenization: text out as tokens arrive, multi-byte characters only when whole."""
from __future__ import annotations

_CONTEXT_TOKENS = 4  # prompt tokens decoded with the output so leading spaces come out right


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int]):
        self.tokenizer = tokenizer
        self.tokens: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)

    def add(self, token_id: int) -> str:
        """Append a token; return the text it completes ("" while a character is still partial)."""
        self.tokens.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.tokens[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        full = decode(self.tokens[self.prefix_offset :], skip_special_tokens=True)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.tokens)
        return full[len(prefix) :]
