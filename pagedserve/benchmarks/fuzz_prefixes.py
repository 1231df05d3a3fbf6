"""The prompt prefixes that fuzzed and reference requests share, so that a prefix-cache
block a hostile request left wrong shows up in a reference answer.

Contract: `Prefixes(seed, tag)` gives `shared(k)`, one of `count` fixed prefixes used all
run long, and `fresh(index)`, a prefix no other request of the run uses, for the probe
`index` to compute first (the reference request that follows it then finds it cached).
Each is about 60 tokens (several 16-token blocks) of plain words; the same seed and tag
give the same text. `tag` keeps two runs against one server apart (default: the seed).
"""
from __future__ import annotations

import random

WORDS = ("the cache block page token model river stone light paper seven quick brown fox over lazy dog "
         "memory kernel table prefix shared copy write serve batch step north winter garden copper "
         "violet engine signal harbor lantern meadow orbit pebble quartz saddle timber velvet willow "
         "yellow zephyr anchor bridge candle desert ember falcon glacier hollow island jungle").split()


class Prefixes:
    def __init__(self, seed: int, tag: str | None = None, count: int = 4, words: int = 48):
        self.seed = seed
        self.tag = str(seed) if tag is None else tag
        self.count = count
        self.words = words

    def _text(self, name: str) -> str:
        rng = random.Random(f"{self.seed}/{self.tag}/{name}")
        body = " ".join(rng.choice(WORDS) for _ in range(self.words))
        return f"[{self.tag} {name}] {body}."

    def shared(self, k: int) -> str:
        return self._text(f"shared {k % self.count}")

    def fresh(self, index: int) -> str:
        return self._text(f"fresh {index}")

    def unique(self, n: int) -> str:
        """The n-th prompt of the references that share no prefix with anything."""
        return self._text(f"unique {n}")
