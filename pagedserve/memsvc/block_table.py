"""One sequence's paged state: its block table, token count, and prefix-cache key chain."""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.memsvc.block_pool import Block, IntegrityError


def blocks_for(num_tokens: int, block_size: int) -> int:
    """ceil(num_tokens / block_size): blocks that hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)


@dataclass(slots=True)
class BlockTable:
    """A sequence's blocks in position order: token at position p lives in
    blocks[p // block_size] at offset p % block_size.

    `block_keys[i]` is the chained prefix-cache key of full block i (kept only with prefix
    caching); `tail_tokens` are the tokens after the last keyed block, waiting for their
    block to fill, or for the id of a pending token (pagedserve.wire.pending_token.PENDING) in it.
    While swapped out, `blocks` is empty and `host_blocks` holds the copies.

    `written`: how many leading blocks are known to hold their K/V (their keys were
    confirmed, pagedserve.memsvc.unwritten_keys); only those are keyed again after a swap-in.

    Sliding window: the first `released` entries of `blocks` are None, blocks freed because
    no layer will read them again (they lie wholly before every future query's window);
    `host_blocks` then holds the copies of the others only.
    """

    seq_id: str
    block_size: int
    max_len: int
    final_len: int | None = None
    salt: str | None = None
    blocks: list[Block] = field(default_factory=list)
    num_tokens: int = 0
    block_keys: list[bytes] = field(default_factory=list)
    tail_tokens: list[int] = field(default_factory=list)
    host_blocks: list[int] = field(default_factory=list)
    swapped: bool = False
    synced: int = 0  # leading blocks the gateway was told about (the rest changed since)
    released: int = 0
    written: int = 0

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.max_len < 1:
            raise ValueError(f"max_len must be positive, got {self.max_len}")
        if self.final_len is not None and not 1 <= self.final_len <= self.max_len:
            raise ValueError(
                f"final_len must be in [1, max_len={self.max_len}], got {self.final_len}"
            )

    @property
    def block_ids(self) -> list[int]:
        """The table as the gateway and executor see it: a released entry is 0 (never read)."""
        return [0 if b is None else b.block_id for b in self.blocks]

    @property
    def live_blocks(self) -> list[Block]:
        return self.blocks[self.released:]

    @property
    def num_held_blocks(self) -> int:
        return len(self.host_blocks) if self.swapped else len(self.blocks) - self.released

    def last_block_partial(self) -> bool:
        return self.num_tokens % self.block_size != 0

    def slots(self, start: int, n: int) -> list[int]:
        """Slot ids (block_id * block_size + offset) of positions start .. start+n-1."""
        bs = self.block_size
        return [self.blocks[p // bs].block_id * bs + p % bs for p in range(start, start + n)]

    def check(self, *, keyed: bool) -> None:
        """Blocks match the token count; with prefix caching, keys match the full blocks."""
        need = blocks_for(self.num_tokens, self.block_size)
        held = self.host_blocks if self.swapped else self.blocks
        if self.swapped:
            need -= self.released
        elif any(b is not None for b in self.blocks[:self.released]) or None in self.live_blocks:
            raise IntegrityError(f"sequence {self.seq_id!r}: released entries must be exactly the first "
                                 f"{self.released}")
        if len(held) != need or (self.swapped and self.blocks):
            raise IntegrityError(
                f"sequence {self.seq_id!r}: {self.num_tokens} tokens need {need} blocks but it"
                f" holds {len(held)} {'host' if self.swapped else 'device'} blocks"
            )
        bs, tail = self.block_size, self.tail_tokens
        # only a pending token (-1) holds keys back, or being swapped out (a fill keys nothing
        # then: its blocks are keyed at the swap-in)
        keyed_all = self.swapped or len(tail) < bs or -1 in tail[:bs]
        if keyed and (len(self.block_keys) * bs + len(tail) != self.num_tokens or not keyed_all):
            raise IntegrityError(
                f"sequence {self.seq_id!r}: {len(self.block_keys)} block keys and"
                f" {len(tail)} tail tokens for {self.num_tokens} tokens"
            )

    def fork(self, child_id: str) -> BlockTable:
        """A copy for `child_id` holding the same blocks (the caller takes the references)."""
        if self.swapped:
            raise ValueError(f"cannot fork {self.seq_id!r}: it is swapped out")
        return BlockTable(
            seq_id=child_id,
            block_size=self.block_size,
            max_len=self.max_len,
            final_len=self.final_len,
            salt=self.salt,
            blocks=list(self.blocks),
            num_tokens=self.num_tokens,
            block_keys=list(self.block_keys),
            tail_tokens=list(self.tail_tokens),
            synced=0,  # the child's first grant carries its whole table (the gateway holds none)
            released=self.released,
            written=self.written,
        )
