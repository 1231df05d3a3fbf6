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
    from pagedserve.gateway.byte_detokenizer import byte_table

    assert byte_table(ByteTokenizer()) is None  # no Rust backend: decoded by its own decode


def test_stop_strings_match_only_after_min_tokens():
    from pagedserve.gateway.output_stream import OutputStream

    tok = ByteTokenizer()
    ids = tok.encode("ab.cd.ef")
    free = OutputStream(tok, tok.encode("Q: "), ["."])
    assert "".join(free.add(t) for t in ids) + free.flush() == "ab" and free.stopped
    held = OutputStream(tok, tok.encode("Q: "), ["."], min_tokens=4)  # "ab.c": the first "." passes
    assert "".join(held.add(t) for t in ids) + held.flush() == "ab.cd" and held.stopped
