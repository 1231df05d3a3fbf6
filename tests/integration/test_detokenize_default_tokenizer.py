"""The fast detokenizers give, token by token, what the default model's tokenizer decodes."""
from pagedserve.gateway.detokenizer import IncrementalDetokenizer


def test_fast_decode_gives_the_text_of_tokenizer_decode(default_model_dir):
    import random

    from pagedserve.gateway.detokenizer import fast_decode
    from pagedserve.gateway.tokenizer import load_tokenizer

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

    from pagedserve.gateway.byte_detokenizer import ByteDetokenizer
    from pagedserve.gateway.byte_tables import byte_table, byte_tables
    from pagedserve.gateway.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model_dir)
    table = byte_table(tok)
    assert table is not None and len(table) == tok.vocab_size
    assert byte_table(tok) is table  # built once
    texts = byte_tables(tok)[1]
    partial = [i for i, b in enumerate(table) if b and b.decode("utf-8", "replace").endswith("\ufffd")]
    assert partial  # the vocabulary has byte-fragment tokens: the check below meets them
    special = list(tok.all_special_ids)
    rng = random.Random(1)
    for _ in range(300):
        pick = lambda: rng.choice(partial) if rng.random() < 0.3 else (  # noqa: E731
            rng.choice(special) if rng.random() < 0.1 else rng.randrange(tok.vocab_size + 8))
        prompt = [pick() for _ in range(rng.randint(1, 6))]
        slow, fast, whole = (IncrementalDetokenizer(tok, prompt), ByteDetokenizer(table, prompt),
                             ByteDetokenizer(table, prompt, texts))
        for _ in range(rng.randint(1, 24)):
            t = pick()
            assert whole.add(t) == fast.add(t) == slow.add(t)
    text = "Hello, wörld! 世界 🎉  two  spaces\n"
    for d in ByteDetokenizer(table, []), ByteDetokenizer(table, [], texts):
        assert "".join(d.add(t) for t in tok.encode(text, add_special_tokens=False)) == text


class DecodeOnly:
    """The tokenizer seen through its decode alone: streams take the general path
    (IncrementalDetokenizer over transformers' decode, clean-up rules included)."""

    def __init__(self, tok):
        self.tok = tok

    def decode(self, ids, skip_special_tokens=False):
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_output_streams_give_what_the_general_path_gives(default_model_dir):
    """Random streams of multi-byte text, byte fragments and special tokens, with and
    without stop strings (some split across tokens, some multi-byte) and min_tokens: the
    gateway's streams (byte tables, whole texts, no stop filter without stop strings) give
    token by token the text, stop and flush of the general path over the tokenizer's decode."""
    import random

    from pagedserve.gateway.byte_tables import byte_tables
    from pagedserve.gateway.output_stream import OutputStream
    from pagedserve.gateway.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model_dir)
    table, texts = byte_tables(tok)
    samples = ["Hello, wörld! 世界 🎉  two  spaces\n", "naïve café — déjà vu ✓ ½ ∑ 日本語のテキスト",
               "emoji 👩‍👩‍👧 and 🇫🇷 flags", "def f(x):\n    return x ** 2  # ok\n"]
    pool = sorted({t for s in samples for t in tok.encode(s, add_special_tokens=False)})
    partial = [i for i, b in enumerate(table) if b and i not in texts]
    special = list(tok.all_special_ids)
    rng = random.Random(2)
    seen_stop = 0
    for _ in range(400):
        pick = lambda: (rng.choice(pool) if rng.random() < 0.6 else rng.choice(partial)  # noqa: E731
                        if rng.random() < 0.5 else rng.choice(special) if rng.random() < 0.1
                        else rng.randrange(tok.vocab_size + 4))
        prompt = [pick() for _ in range(rng.randint(1, 6))]
        ids = [pick() for _ in range(rng.randint(1, 30))]
        whole = tok.decode(ids, skip_special_tokens=True)
        stop = []
        if rng.random() < 0.6 and whole:  # a piece of the text, or of another sample
            source = whole if rng.random() < 0.7 else rng.choice(samples)
            at = rng.randrange(len(source))
            stop.append(source[at:at + rng.randint(1, 4)])
        if rng.random() < 0.2:
            stop.append(rng.choice(["é", "世界", " the", "\n"]))
        min_tokens = rng.choice([0, 0, 2, 5])
        fast = OutputStream(tok, prompt, stop, min_tokens)
        general = OutputStream(DecodeOnly(tok), prompt, stop, min_tokens)
        assert type(fast.detok).__name__ == "ByteDetokenizer"
        assert type(general.detok).__name__ == "IncrementalDetokenizer"
        for t in ids:
            if general.stopped:
                break
            assert fast.add(t) == general.add(t)
            assert fast.stopped == general.stopped
        seen_stop += general.stopped
        assert fast.flush() == general.flush()
    assert seen_stop > 20  # stop strings were met
