"""memsvc: the KV block manager (pure Python; the gRPC service wraps it).

Contracts the scheduler relies on:
- Blocks hold `block_size` token slots; slot = block_id * block_size + offset. A sequence's
  block table lists, in position order, the blocks holding its tokens.
- Check, then act: `admit` -> `add_sequence`, `can_append`/`num_new_blocks` -> `append`,
  `can_swap_out` -> `swap_out`, `can_swap_in` -> `swap_in`. An act that lacks space raises
  NoFreeBlocks and leaves every state unchanged. Unknown sequence ids raise KeyError.
- `admit` answers Admission("yes" | "wait" | "never", reason); "never" says which limit
  the request exceeds (the whole sequence, prompt + max_tokens, does not fit in the pool).
- `add_sequence` returns the number of prompt tokens already cached (a multiple of
  block_size, at most len(prompt) - 1); the first `append` gives slots to the tokens right
  after them. `append` returns the slot mapping and the (src, dst) block copies the caller
  must perform BEFORE writing (copy-on-write of a shared partial last block).
- `swap_out` / `swap_in` return (src, dst) block pairs (device->host, host->device); the
  caller copies them before the freed blocks are written again (swap-out) or before the
  sequence's next step (swap-in).
- `free` of an id twice raises KeyError; releasing a block twice raises DoubleFree.
- `snapshot` partitions the pool's slots into token state, reserved, internal and external
  fragmentation, and free (see pagedserve.memsvc.accounting). `check_integrity` raises
  IntegrityError: free + cached + referenced == num_blocks, and each block's ref count
  equals the number of block tables holding it.
- Policy asks, mechanism acts: nothing here preempts or picks a sequence; it only answers
  and executes.
"""
from pagedserve.memsvc.accounting import PoolSnapshot
from pagedserve.memsvc.admission import Admission
from pagedserve.memsvc.allocator import POLICIES, AppendResult, KVAllocator
from pagedserve.memsvc.block_pool import (
    BlockPool,
    DoubleFree,
    IntegrityError,
    NoFreeBlocks,
)
from pagedserve.memsvc.contiguous_allocator import ContiguousAllocator
from pagedserve.memsvc.factory import make_allocator
from pagedserve.memsvc.paged_allocator import PagedAllocator
from pagedserve.memsvc.prefix_cache import block_key
from pagedserve.memsvc.run_allocator import Run, RunAllocator
from pagedserve.memsvc.swap_space import SwapSpace

__all__ = [
    "POLICIES",
    "Admission",
    "AppendResult",
    "BlockPool",
    "ContiguousAllocator",
    "DoubleFree",
    "IntegrityError",
    "KVAllocator",
    "NoFreeBlocks",
    "PagedAllocator",
    "PoolSnapshot",
    "Run",
    "RunAllocator",
    "SwapSpace",
    "block_key",
    "make_allocator",
]
