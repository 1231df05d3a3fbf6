"""Prefix-cache block keys, shared by memsvc (which caches blocks under them) and the gateway
(which routes a prompt to the replica that already holds its leading blocks).

key(block i) = blake2b(key(block i-1), salt, tokens of block i). Two blocks share a key
only if the whole prefix up to and including them is identical (and the salt is the same),
so a cache hit on block i implies hits on blocks 0..i-1 under the same keys. The hash is
stable across processes and runs (a deterministic byte encoding, never Python's hash()).

The salt isolates tenants or adapters: the same tokens under different salts never share
a block. None means "no salt"; it is encoded differently from "" (an empty salt).
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

KEY_BYTES = 32
_START = hashlib.blake2b(digest_size=KEY_BYTES, person=b"pagedserve-kv")  # copied per key: cheaper than a new one
_NO_PARENT = b"\x00" * KEY_BYTES


def block_key(parent: bytes | None, tokens: Sequence[int], salt: str | None = None) -> bytes:
    """The key of a full block with `tokens`, following the block keyed `parent` (None: first)."""
    h = _START.copy()
    h.update(_NO_PARENT if parent is None else parent)
    if salt is None:
        h.update(b"\x00")
    else:
        encoded = salt.encode("utf-8")
        h.update(b"\x01" + struct.pack("<Q", len(encoded)) + encoded)
    h.update(struct.pack(f"<Q{len(tokens)}q", len(tokens), *tokens))
    return h.digest()


def prompt_block_keys(
    token_ids: Sequence[int],
    block_size: int,
    salt: str | None = None,
    *,
    max_blocks: int | None = None,
    parent: bytes | None = None,
) -> list[bytes]:
    """Chained keys of the full blocks of `token_ids` (at most `max_blocks` of them)."""
    n = len(token_ids) // block_size
    if max_blocks is not None:
        n = min(n, max_blocks)
    keys = []
    for i in range(n):
        parent = block_key(parent, token_ids[i * block_size : (i + 1) * block_size], salt)
        keys.append(parent)
    return keys


def cacheable_blocks(prompt_len: int, block_size: int) -> int:
    """Full prompt blocks a hit may cover: the last prompt token is always computed."""
    return max(prompt_len - 1, 0) // block_size
