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

    from pagedserve.gateway.byte_detokenizer import ByteDetokenizer, byte_table
    from pagedserve.gateway.tokenizer import load_tokenizer

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
