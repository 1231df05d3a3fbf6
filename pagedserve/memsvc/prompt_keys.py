"""The chained block keys of the prompt last walked for prefix-cache hits, each computed once.

An admission meets the same prompt blocks three times: its check (`admit`) and its act
(`add_sequence`) walk them for hits (pagedserve.memsvc.prefix_admission), then the keying of
the blocks its first chunk fills (PagedAllocator._key_tail) keys them. A key is a pure
function of its parent key, its tokens and the salt (pagedserve.wire.block_keys.block_key):
one taken from here is the one `block_key` would give, as `known` checks all three.
"""
from __future__ import annotations

from pagedserve.memsvc.prefix_cache import block_key


class PromptKeys:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.prompt: list[int] = []  # a copy of the prompt walked last
        self.salt: str | None = None
        self.keys: list[bytes] = []  # of its blocks 0, 1, ..., as far as computed

    def start(self, prompt: list[int], salt: str | None) -> None:
        """The walk of `prompt` begins: keep what was computed for it, if it is the last one."""
        if salt != self.salt or prompt != self.prompt:
            self.prompt, self.salt, self.keys = list(prompt), salt, []

    def block(self, i: int) -> bytes:
        """The key of block i of the prompt `start` named (and of the blocks before it)."""
        keys, bs = self.keys, self.block_size
        while len(keys) <= i:
            j = len(keys)
            keys.append(block_key(keys[-1] if keys else None, self.prompt[j * bs:(j + 1) * bs], self.salt))
        return keys[i]

    def known(self, i: int, parent: bytes | None, tokens: list[int], salt: str | None) -> bytes | None:
        """block_key(parent, tokens, salt) where that is block i of the prompt, computed
        already; None otherwise."""
        keys, bs = self.keys, self.block_size
        if (i < len(keys) and salt == self.salt and parent == (keys[i - 1] if i else None)
                and tokens == self.prompt[i * bs:(i + 1) * bs]):
            return keys[i]
        return None
