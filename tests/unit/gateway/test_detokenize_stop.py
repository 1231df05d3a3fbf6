"""Incremental detokenization and stop strings, on a byte-level toy tokenizer."""
from gateway.detokenizer import IncrementalDetokenizer
from gateway.stop_strings import StopStringFilter


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


def test_fast_decode_gives_the_text_of_tokenizer_decode(default_model_dir):
    import random

    from gateway.detokenizer import fast_decode
    from gateway.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model_dir)
    decode = fast_decode(tok)
    assert decode is not None and tok.backend_tokenizer is not None
    rng = random.Random(0)
    special = list(tok.all_special_ids)
    for _ in range(300):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 12))]
        if rng.random() < 0.3:
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(special))
        assert decode(ids) == tok.decode(ids, skip_special_tokens=True)
    text = "Hello, wörld! 世界 🎉  two  spaces\n"
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, [])
    assert "".join(d.add(t) for t in ids) == text


def test_byte_detokenizer_gives_what_the_tokenizer_gives(default_model_dir):
    """Over random streams (special tokens, ids whose bytes are partial characters, ids past
    the vocabulary) and random prompt contexts, token by token the same text."""
    import random

    from gateway.byte_detokenizer import ByteDetokenizer, byte_table
    from gateway.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model_dir)
    table = byte_table(tok)
    assert table is not None and len(table) == tok.vocab_size
    assert byte_table(tok) is table  # built once
    partial = [i for i, b in enumerate(table) if b and b.decode("utf-8", "replace").endswith("\ufffd")]
    assert partial  # the vocabulary has byte-fragment tokens: the check below meets them
    special = list(tok.all_special_ids)
    rng = random.Random(1)
    for _ in range(300):
        pick = lambda: rng.choice(partial) if rng.random() < 0.3 else (  # noqa: E731
            rng.choice(special) if rng.random() < 0.1 else rng.randrange(tok.vocab_size + 8))
        prompt = [pick() for _ in range(rng.randint(1, 6))]
        slow, fast = IncrementalDetokenizer(tok, prompt), ByteDetokenizer(table, prompt)
        for _ in range(rng.randint(1, 24)):
            t = pick()
            assert fast.add(t) == slow.add(t)
    text = "Hello, wörld! 世界 🎉  two  spaces\n"
    d = ByteDetokenizer(table, [])
    assert "".join(d.add(t) for t in tok.encode(text, add_special_tokens=False)) == text


def test_no_byte_table_for_a_tokenizer_that_is_not_byte_level():
    from gateway.byte_detokenizer import byte_table

    assert byte_table(ByteTokenizer()) is None  # no Rust backend: decoded by its own decode
