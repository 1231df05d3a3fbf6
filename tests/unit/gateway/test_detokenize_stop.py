"""Incremental detokenization and stop strings, on a byte-level toy tokenizer."""
from pagedserve.gateway.detokenizer import IncrementalDetokenizer
from pagedserve.gateway.stop_strings import StopStringFilter


class ByteTokenizer:
    """One token per byte, decoded like a byte-level BPE: broken UTF-8 becomes U+FFFD."""

    def encode(self, text):
        return list(text.encode())

    def decode(self, ids, skip_special_tokens=False):
        return bytes(ids).decode("utf-8", errors="replace")


def stream(text, prompt="Q: "):
    tok = ByteTokenizer()
    d = IncrementalDetokenizer(tok, tok.encode(prompt))
    return [d.add(t) for t in tok.encode(text)]


def test_multibyte_characters_come_out_whole():
    pieces = stream("héllo 世界 🎉!")
    assert "".join(pieces) == "héllo 世界 🎉!"
    assert all("\ufffd" not in p for p in pieces)
    assert "世" in pieces and "🎉" in pieces  # emitted once complete, not byte by byte
    assert pieces[pieces.index("🎉") - 1] == ""  # the last partial byte emitted nothing


def test_stop_string_split_across_pieces_is_not_leaked():
    f = StopStringFilter(["STOP"])
    out = "".join(f.feed(p) for p in ["hello S", "T", "OP and more"])
    assert out == "hello " and f.stopped


def test_partial_stop_prefix_is_released_when_it_does_not_complete():
    f = StopStringFilter(["STOP"])
    out = f.feed("a ST") + f.feed("ay")
    assert not f.stopped
    assert out + f.flush() == "a STay"


def test_earliest_of_several_stop_strings_wins():
    f = StopStringFilter(["world", "lo w"])
    assert f.feed("hello world") == "hel" and f.stopped
    assert f.feed("more") == "" and f.flush() == ""


def test_no_stop_strings_passes_everything_through():
    f = StopStringFilter([])
    assert f.feed("abc") == "abc" and f.flush() == ""


def test_no_byte_table_for_a_tokenizer_that_is_not_byte_level():
    from pagedserve.gateway.byte_tables import byte_table

    assert byte_table(ByteTokenizer()) is None  # no Rust backend: decoded by its own decode


def test_stop_strings_match_only_after_min_tokens():
    from pagedserve.gateway.output_stream import OutputStream

    tok = ByteTokenizer()
    ids = tok.encode("ab.cd.ef")
    free = OutputStream(tok, tok.encode("Q: "), ["."])
    assert "".join(free.add(t) for t in ids) + free.flush() == "ab" and free.stopped
    held = OutputStream(tok, tok.encode("Q: "), ["."], min_tokens=4)  # "ab.c": the first "." passes
    assert "".join(held.add(t) for t in ids) + held.flush() == "ab.cd" and held.stopped


class TableTokenizer:
    """A byte-level toy: every byte, then multi-byte ids (whole characters, U+FFFD itself, a
    character's first bytes, text with a broken byte inside)."""

    TABLE = [bytes([b]) for b in range(256)] + [
        "é".encode(), "世界".encode(), "🎉".encode(), b"\xef\xbf\xbd", b"a\xef\xbf\xbd", "世".encode()[:2],
        b"\xffab", b"ok", b"", b" the",
    ]

    def decode(self, ids, skip_special_tokens=False):
        return b"".join(self.TABLE[i] if 0 <= i < len(self.TABLE) else b"" for i in ids).decode("utf-8", "replace")


def test_whole_texts_leave_out_what_can_read_as_partial():
    from pagedserve.gateway.byte_tables import whole_texts

    texts = whole_texts(TableTokenizer.TABLE)
    assert texts[ord("a")] == "a" and texts[256] == "é" and texts[257] == "世界" and texts[265] == " the"
    for i in [0x80, 0xC3, 0xFF, 259, 260, 261, 262, 264]:  # partial, U+FFFD at the end, broken, b""
        assert i not in texts


def test_byte_detokenizer_short_way_gives_what_decode_gives():
    """Random streams over the toy: with its whole texts, without, and the tokenizer's decode
    agree token by token."""
    import random

    from pagedserve.gateway.byte_detokenizer import ByteDetokenizer
    from pagedserve.gateway.byte_tables import whole_texts

    tok, table = TableTokenizer(), TableTokenizer.TABLE
    texts = whole_texts(table)
    multi = list(range(256, len(table))) + [0xC3, 0xA9, 0xE4, 0xB8, 0x96, 0xF0, 0x9F, 0x8E, 0x89, 0xFF]
    rng = random.Random(3)
    for _ in range(2000):
        pick = lambda: rng.choice(multi) if rng.random() < 0.5 else rng.randrange(-2, len(table) + 3)  # noqa: E731
        prompt = [pick() for _ in range(rng.randint(1, 6))]
        ref, fast, plain = (IncrementalDetokenizer(tok, prompt), ByteDetokenizer(table, prompt, texts),
                            ByteDetokenizer(table, prompt))
        for _ in range(rng.randint(1, 20)):
            t = pick()
            assert fast.add(t) == plain.add(t) == ref.add(t)


def test_stop_filter_emits_what_a_search_of_all_the_text_allows():
    """Random pieces and stop strings: after each piece the text out so far is all the text
    up to the earliest stop string, or all but the last (longest stop - 1) characters."""
    import random

    rng = random.Random(4)
    alphabet = "ab é世\n"
    for _ in range(3000):
        stop = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 4))) for _ in range(rng.randint(0, 3))]
        f, out, text = StopStringFilter(stop), "", ""
        hold = max((len(s) for s in stop if s), default=1) - 1
        for _ in range(rng.randint(1, 8)):
            piece = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 5)))
            text += piece
            out += f.feed(piece)
            hits = [text.find(s) for s in stop if s and s in text]
            assert f.stopped == bool(hits)
            if hits:
                assert out == text[:min(hits)] and f.feed("more") == "" and f.flush() == ""
                break
            assert out == text[:max(len(text) - hold, 0)]
        else:
            assert out + f.flush() == text
