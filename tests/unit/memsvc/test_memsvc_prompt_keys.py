"""PromptKeys: each key it gives is the one block_key gives; it answers only for the prompt
walked last, at the same parent, tokens and salt."""
import random

from pagedserve.memsvc.prompt_keys import PromptKeys
from pagedserve.wire.block_keys import block_key, prompt_block_keys


def test_its_keys_are_block_keys_and_only_for_the_same_inputs():
    rng = random.Random(0)
    walk = PromptKeys(4)
    for _ in range(200):
        prompt = [rng.randrange(3) for _ in range(rng.randrange(0, 14))]
        salt = rng.choice([None, "", "x"])
        walk.start(prompt, salt)
        n = len(prompt) // 4
        upto = rng.randrange(n + 1)
        assert [walk.block(i) for i in range(upto)] == prompt_block_keys(prompt, 4, salt)[:upto]
        for _ in range(5):  # what _key_tail asks: any block, parent, tokens, salt
            i = rng.randrange(4)
            tokens = prompt[i * 4:(i + 1) * 4] if rng.random() < 0.7 else [rng.randrange(3) for _ in range(4)]
            parent = rng.choice([None, walk.keys[i - 1] if 0 < i <= len(walk.keys) else b"p" * 32, b"q" * 32])
            s = salt if rng.random() < 0.8 else rng.choice([None, "", "x"])
            known = walk.known(i, parent, tokens, s)
            assert known is None or known == block_key(parent, tokens, s)
            if i < upto and s == salt and tokens == prompt[i * 4:(i + 1) * 4] and parent == (walk.keys[i - 1] if i else None):
                assert known is not None
        prompt[:] = [rng.randrange(3) for _ in prompt]  # the caller may change its list: a new prompt
        walk.start(prompt, salt)
        assert [walk.block(i) for i in range(n)] == prompt_block_keys(prompt, 4, salt)
