"""make_allocator: one allocation policy by name, over a pool of the given size."""
from __future__ import annotations

from pagedserve.memsvc.allocator import POLICIES, KVAllocator
from pagedserve.memsvc.contiguous_allocator import ContiguousAllocator
from pagedserve.memsvc.paged_allocator import PagedAllocator


def make_allocator(
    policy: str,
    num_blocks: int,
    block_size: int,
    *,
    max_model_len: int,
    enable_prefix_caching: bool = True,
    num_host_blocks: int = 0,
    window: int | None = None,
    num_offload_blocks: int = 0,
) -> KVAllocator:
    """`policy` in POLICIES. Prefix caching, host blocks, the prefix cache's host tier
    (`num_offload_blocks`) and freeing blocks past a sliding `window` apply to `paged` only."""
    if policy == "paged":
        return PagedAllocator(
            num_blocks,
            block_size,
            enable_prefix_caching=enable_prefix_caching,
            num_host_blocks=num_host_blocks,
            window=window,
            num_offload_blocks=num_offload_blocks,
        )
    if policy in POLICIES:
        return ContiguousAllocator(num_blocks, block_size, policy, max_model_len)
    raise ValueError(f"unknown allocation policy {policy!r}; choose one of {', '.join(POLICIES)}")
