"""The device block pool: fixed blocks, ref counts, and an O(1) free queue.

Mechanism only. The pool never chooses which sequence gets a block; it hands out blocks
from the head of its free queue when asked and takes them back at the tail.

Free queue: an intrusive doubly linked list threaded through the blocks themselves (the
shape of vLLM v1's FreeKVCacheBlockQueue), so allocate (pop head), free (push tail) and
a prefix-cache hit on a free block (remove from the middle) are all O(1).

Prefix-cached blocks: a block freed while it carries a prefix-cache key stays keyed in the
free queue and can be revived by a cache hit until an allocation pops it; the key is
evicted then (lazy eviction). The head of the queue is the least recently used block, so
eviction is LRU. Callers free a sequence's blocks in reverse order so that, among blocks
freed together, tail blocks are evicted before the head blocks other prompts share.
A freed block without a key holds nothing worth keeping: it goes to the head, so it is
reused before any cached block. A block's `gen` counts its allocations, so a holder of
its id can tell whether it was handed out again since. `on_evict` (optional) sees each keyed block as an
allocation evicts it, before its key is dropped (pagedserve.memsvc.prefix_offload copies it to the
host tier); `stamp` is recorded in each block keyed (`keyed_at`), so the caller can tell
which blocks' contents may not be final yet.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field


class NoFreeBlocks(RuntimeError):
    """Raised when an operation needs more free blocks than there are; nothing was changed."""


class DoubleFree(RuntimeError):
    """Raised when a block (or a sequence, or a run) is freed more often than it was taken."""


class IntegrityError(RuntimeError):
    """Raised by check_integrity; the message names the block or sequence that is wrong."""


@dataclass(eq=False, slots=True)
class Block:
    """One KV block. `key` is its prefix-cache key when it holds a full, keyed block, keyed
    under `salt` at the pool's stamp `keyed_at`."""

    block_id: int
    ref_cnt: int = 0
    key: bytes | None = None
    salt: str | None = None
    keyed_at: int = 0
    gen: int = 0  # allocations of this block so far
    prev_free: Block | None = field(default=None, repr=False)
    next_free: Block | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.block_id < 0:
            raise ValueError(f"block_id must be >= 0, got {self.block_id}")


class FreeBlockQueue:
    """Doubly linked list of free blocks between two sentinels; head = next to evict."""

    def __init__(self, blocks: Iterable[Block] = ()) -> None:
        self._head = Block(0)  # sentinels: never handed out
        self._tail = Block(0)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> Block:
        block = self._head.next_free
        if block is self._tail:
            raise NoFreeBlocks("the free block queue is empty")
        self.remove(block)
        return block

    def popleft_many(self, n: int) -> list[Block]:
        """The first `n` blocks, taken out at once (the caller checked there are `n`)."""
        out = []
        block = self._head.next_free
        for _ in range(n):
            out.append(block)
            block.prev_free = None
            block, out[-1].next_free = block.next_free, None
        self._head.next_free = block
        block.prev_free = self._head
        self.num_free -= n
        return out

    def remove(self, block: Block) -> None:
        if block.prev_free is None or block.next_free is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def _insert_after(self, anchor: Block, block: Block) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        block.prev_free, block.next_free = anchor, anchor.next_free
        anchor.next_free.prev_free = block
        anchor.next_free = block
        self.num_free += 1

    def append(self, block: Block) -> None:
        self._insert_after(self._tail.prev_free, block)

    def appendleft(self, block: Block) -> None:
        self._insert_after(self._head, block)

    def __iter__(self) -> Iterator[Block]:
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free

    def __len__(self) -> int:
        return self.num_free


class BlockPool:
    """`num_blocks` blocks with ref counts, the free queue, and the prefix-cache key map."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, Block] = {}
        self.on_evict: Callable[[Block], None] | None = None
        self.stamp = 0

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now: never used, freed, or cached with ref 0."""
        return self.free_queue.num_free

    def allocate(self, n: int) -> list[Block]:
        """Pop `n` blocks from the head (LRU), evicting their keys; each gets ref count 1."""
        queue = self.free_queue
        if n > queue.num_free:
            raise NoFreeBlocks(f"needs {n} free blocks, {queue.num_free} free")
        out = queue.popleft_many(n)
        for block in out:
            if block.key is not None:
                if self.on_evict is not None:
                    self.on_evict(block)
                del self.cached[block.key]
                block.key = None
            block.ref_cnt = 1
            block.gen += 1
        return out

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference from each block, in order; those reaching 0 join the queue."""
        blocks = list(blocks)
        for block in blocks:
            if block.ref_cnt <= 0:
                raise DoubleFree(f"block {block.block_id} freed twice (ref count is already 0)")
        if len({id(b) for b in blocks}) != len(blocks):
            raise DoubleFree("the same block appears twice in one free call")
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.key is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def incref(self, blocks: Iterable[Block]) -> None:
        """Take one more reference to each block; a free (cached) block leaves the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def lookup(self, key: bytes) -> Block | None:
        return self.cached.get(key)

    def cache(self, block: Block, key: bytes, salt: str | None = None) -> bool:
        """Key a full block; False (and no change) if the key already names another block.
        A free block keyed moves from the head of the queue to the tail (cached, LRU)."""
        if block.key is not None:
            return block.key == key
        if key in self.cached:
            return False
        block.key, block.salt, block.keyed_at = key, salt, self.stamp
        self.cached[key] = block
        if block.ref_cnt == 0:
            self.free_queue.remove(block)
            self.free_queue.append(block)
        return True

    def counts(self) -> tuple[int, int, int]:
        """(free, cached, referenced): free = ref 0 without key, cached = ref 0 with key."""
        referenced = sum(1 for b in self.blocks if b.ref_cnt > 0)
        cached = sum(1 for b in self.blocks if b.ref_cnt == 0 and b.key is not None)
        return self.num_blocks - referenced - cached, cached, referenced

    def check(self) -> None:
        """Free queue and key map agree with the ref counts; IntegrityError otherwise
        (pagedserve.memsvc.pool_integrity)."""
        from pagedserve.memsvc.pool_integrity import check_pool  # it imports this module

        check_pool(self)
