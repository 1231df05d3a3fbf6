"""How big a request may be beyond its fields' own ranges (pagedserve.wire.sampling_fields), alike on
both APIs.

- MAX_PROMPTS prompts in one completions request (each a request to the batching loop),
  MAX_MESSAGES messages in a chat, MAX_CONTENT_PARTS parts in one message's content,
  MAX_TOOLS tools (OpenAI's bound) and MAX_TOOL_CALLS calls in one message; a JSON body
  nests at most MAX_JSON_DEPTH levels.
- `check_prompt_bytes`: a text prompt (a chat: its messages' contents together) is refused
  by its size, before it is tokenized, when the model's maximum length could not hold it.
  A token stands for at most as many bytes as its vocabulary's longest entry takes in
  UTF-8 (entries are stored at least as long as what they stand for: byte-level BPE writes
  a byte as one or two bytes, SentencePiece a space as the three of "▁"), and a tokenizer's
  normalizer shortens text less than fourfold (NFKC maps the 4-byte "𝐀" to "A"; NFC three
  3-byte Hangul jamo to one 3-byte syllable). So a text of more than
  max_model_len * 4 * (longest entry) bytes has more tokens than the model can take:
  tokenizing it would be work (seconds, for megabytes) for nothing.
"""
from __future__ import annotations

import threading

MAX_PROMPTS = 128
MAX_MESSAGES = 2048
MAX_CONTENT_PARTS = 256
MAX_TOOLS = 128
MAX_TOOL_CALLS = 128
MAX_JSON_DEPTH = 64
NORMALIZER_SHRINK = 4

_per_token: dict[int, tuple[object, int | None]] = {}
_lock = threading.Lock()


def utf8_size(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def bytes_per_token(tokenizer) -> int | None:
    """The most UTF-8 bytes one token of `tokenizer` may stand for (see above); None when
    the tokenizer does not list its vocabulary. Computed once per tokenizer."""
    with _lock:
        known = _per_token.get(id(tokenizer))
    if known is not None and known[0] is tokenizer:
        return known[1]
    get_vocab = getattr(tokenizer, "get_vocab", None)
    longest = max((utf8_size(t) for t in get_vocab()), default=0) if get_vocab else 0
    per = NORMALIZER_SHRINK * longest or None
    with _lock:
        _per_token[id(tokenizer)] = (tokenizer, per)
    return per


def check_prompt_bytes(size: int, max_model_len: int, tokenizer, what: str) -> None:
    """ValueError naming `what` when `size` bytes of text cannot fit in max_model_len tokens."""
    per = bytes_per_token(tokenizer)
    if per is None or size <= per * max_model_len:
        return
    raise ValueError(
        f"{what} is {size} bytes of UTF-8, more than the model's maximum length of {max_model_len} "
        f"tokens can hold: at most {per * max_model_len} bytes ({per} a token, 4 times its "
        "vocabulary's longest entry)")
