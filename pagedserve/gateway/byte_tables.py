"""Each token's bytes for a byte-level BPE tokenizer (GPT-2, Llama 3, Qwen2, SmolLM2), read
once per tokenizer and checked id by id against the tokenizer's own decode, and the ids whose
bytes are whole UTF-8 text on their own: the tables pagedserve.gateway.byte_detokenizer
decodes from.
"""
from __future__ import annotations

import weakref

_tables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _char_to_byte() -> dict[str, int]:
    """The inverse of GPT-2's bytes-to-unicode map: printable bytes stand for themselves,
    the others for the code points from 256 on, in byte order."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = {chr(b): b for b in printable}
    n = 0
    for b in range(256):
        if b not in printable:
            chars[chr(256 + n)] = b
            n += 1
    return chars


def byte_table(tokenizer) -> list[bytes] | None:
    """Each id's bytes (b"" for what decode skips: special tokens), or None where the
    tokenizer is not a plain byte-level BPE (another decoder, clean-up after decoding, or any
    id whose own decode differs from its bytes' text). Built once per tokenizer (~0.1 s)."""
    tables = byte_tables(tokenizer)
    return tables[0] if tables is not None else None


def byte_tables(tokenizer) -> tuple[list[bytes], dict[int, str]] | None:
    """`byte_table` and `whole_texts` of it, built once per tokenizer."""
    try:
        return _tables[tokenizer]
    except (KeyError, TypeError):
        pass
    table = _build(tokenizer)
    tables = (table, whole_texts(table)) if table is not None else None
    try:
        _tables[tokenizer] = tables
    except TypeError:  # not weakly referenceable: build it again next time
        pass
    return tables


def whole_texts(table: list[bytes]) -> dict[int, str]:
    """The ids whose bytes are whole UTF-8 text on their own, to that text; left out: b"",
    partial or broken characters, and text ending in U+FFFD (which reads as partial)."""
    texts = {}
    for i, data in enumerate(table):
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if text and not text.endswith("\ufffd"):
            texts[i] = text
    return texts


def _build(tokenizer) -> list[bytes] | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True) is not False
            or type(backend.decoder).__name__ != "ByteLevel"):
        return None
    chars = _char_to_byte()
    size = backend.get_vocab_size(with_added_tokens=True)
    if backend.decode([size], skip_special_tokens=True) != "":  # ids past the vocabulary
        return None
    table = []
    for i in range(size):
        text = backend.decode([i], skip_special_tokens=True)
        token = backend.id_to_token(i)
        if text == "" or token is None:
            data = b""
        else:
            try:
                data = bytes(chars[c] for c in token)
            except KeyError:  # a token outside the byte alphabet (an added one) stands for its UTF-8
                data = token.encode()
        if data.decode("utf-8", "replace") != text:
            return None
        table.append(data)
    return table
