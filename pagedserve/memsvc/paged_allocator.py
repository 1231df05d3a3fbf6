"""Paged allocation: per-sequence block tables over a shared BlockPool.

A sequence holds ceil(num_tokens / block_size) blocks and takes a new one only when its
last block is full; a write into a shared partial last block copies it first
(copy-on-write). Full blocks are keyed for the prefix cache as they fill, and become hits
only once the step that writes them is confirmed to have run
(pagedserve.memsvc.unwritten_keys). Every copy is returned as (src, dst) pairs for the
caller to do.

What a steady step does not run lives in modules of their own, functions of the allocator:
a new sequence over its cached prefix (pagedserve.memsvc.prefix_admission), forks
(pagedserve.memsvc.sequence_fork), swap out and in (pagedserve.memsvc.sequence_swap), one
pending token's fill (pagedserve.memsvc.pending_fill). A steady step's running sequences
grow in one pass (pagedserve.memsvc.running_growth).

With a sliding `window` (every layer's; KVGeometry.window), a step that computes positions
from p on frees the sequence's blocks that lie wholly before p - window + 1: no query of
this sequence will read them again. They are freed like any block (a prefix-cached one
stays cached until evicted, so other prompts still match it); the table keeps a hole (sent
as block 0, which the kernels never read for it), swap-out copies only the live blocks.

With a host tier (`num_offload_blocks` > 0, pagedserve.memsvc.prefix_offload), evicted cached blocks
are copied to host memory and a prefix walk continues there after the pool's hits; the
copies are taken with `take_copies()` in the order decided.
"""
from __future__ import annotations

from pagedserve.memsvc import pending_fill, prefix_admission, sequence_fork, sequence_growth, sequence_swap, steady_fills
from pagedserve.memsvc.accounting import PoolSnapshot, paged_snapshot
from pagedserve.memsvc.admission import Admission
from pagedserve.memsvc.allocator import AppendResult, Growth, KVAllocator, RunGrowth
from pagedserve.memsvc.block_pool import BlockPool
from pagedserve.memsvc.block_table import BlockTable, blocks_for
from pagedserve.memsvc.host_tier import HostTier
from pagedserve.memsvc.prefix_cache import PrefixCacheStats, block_key
from pagedserve.memsvc.prefix_offload import PrefixOffload
from pagedserve.memsvc.prompt_keys import PromptKeys
from pagedserve.memsvc.paged_integrity import check_paged_integrity
from pagedserve.memsvc.running_growth import grow_running
from pagedserve.memsvc.steady_fills import SteadyFills
from pagedserve.memsvc.swap_space import SwapSpace
from pagedserve.memsvc.unwritten_keys import UnwrittenKeys
from pagedserve.wire.pending_token import PENDING
from pagedserve.wire.reserve_messages import Fills


class PagedAllocator(KVAllocator):
    supports_swap = True

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        num_host_blocks: int = 0,
        window: int | None = None,
        num_offload_blocks: int = 0,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if window is not None and window < 1:
            raise ValueError(f"window must be positive, got {window}")
        self.window = window
        self.blocks_released = 0  # blocks freed for having left the window, in all
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.swap_space = SwapSpace(num_host_blocks)
        self.prefix_stats = PrefixCacheStats()
        self.unwritten = UnwrittenKeys(self.pool)
        self.prompt_keys = PromptKeys(block_size)
        self._seqs: dict[str, BlockTable] = {}
        # sequences whose partial last block another table may hold too (forks): a superset
        # of those a growth would copy, pruned as it is checked (sequence_fork.may_copy;
        # check_integrity)
        self.shared_tails: set[str] = set()
        self.offload: PrefixOffload | None = None
        if num_offload_blocks and enable_prefix_caching:
            self.offload = PrefixOffload(self.pool, HostTier(num_offload_blocks), block_size)

    @property
    def prefix_cache_queries(self) -> int:
        """Prompt tokens looked up in the prefix cache (every prompt token of every add)."""
        return self.prefix_stats.queries

    @property
    def prefix_cache_hits(self) -> int:
        """Prompt tokens found cached (what add_sequence returned, summed)."""
        return self.prefix_stats.hits

    # -- lookups -------------------------------------------------------------------------

    def _get(self, seq_id: str, *, on_device: bool = True) -> BlockTable:
        table = self._seqs.get(seq_id)
        if table is None:
            raise KeyError(f"unknown sequence {seq_id!r}")
        if on_device and table.swapped:
            raise ValueError(f"sequence {seq_id!r} is swapped out; swap it in first")
        return table

    def take_copies(self) -> list[tuple[str, int, int]]:
        return self.offload.take() if self.offload else []

    def has_sequence(self, seq_id: str) -> bool:
        return seq_id in self._seqs

    def sequence_ids(self) -> list[str]:
        return list(self._seqs)

    def block_table(self, seq_id: str) -> list[int]:
        return self._get(seq_id).block_ids

    def table_changes(self, seq_id: str) -> tuple[int, list[int]]:
        return self._table_changes(self._get(seq_id))

    @staticmethod
    def _table_changes(table: BlockTable) -> tuple[int, list[int]]:
        start = table.synced
        if start == len(table.blocks):
            return start, []
        table.synced = len(table.blocks)
        return start, [0 if b is None else b.block_id for b in table.blocks[start:]]

    def num_tokens(self, seq_id: str) -> int:
        return self._get(seq_id, on_device=False).num_tokens

    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def is_swapped(self, seq_id: str) -> bool:
        return self._get(seq_id, on_device=False).swapped

    # -- admission and growth ------------------------------------------------------------

    def admit(self, prompt_token_ids: list[int], max_len: int, salt: str | None = None, *,
              final_len: int | None = None, use_cache: bool = True) -> Admission:
        return prefix_admission.admit(self, prompt_token_ids, max_len, salt, use_cache)

    def add_sequence(self, seq_id: str, prompt_token_ids: list[int], *, max_len: int,
                     final_len: int | None = None, salt: str | None = None, use_cache: bool = True) -> int:
        return prefix_admission.add_sequence(self, seq_id, prompt_token_ids, max_len=max_len,
                                             final_len=final_len, salt=salt, use_cache=use_cache)

    def _needs_cow(self, table: BlockTable, n: int) -> bool:
        return n > 0 and table.num_tokens % self.block_size != 0 and table.blocks[-1].ref_cnt > 1

    def needs_copy(self, seq_id: str, num_new_tokens: int) -> bool:
        return self._needs_cow(self._get(seq_id), num_new_tokens)

    def num_new_blocks(self, seq_id: str, num_new_tokens: int) -> int:
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        table = self._get(seq_id)
        grow = blocks_for(table.num_tokens + num_new_tokens, self.block_size) - len(table.blocks)
        return grow + int(self._needs_cow(table, num_new_tokens))

    def growth_as_is(self, seq_id: str, num_new_tokens: int) -> int | None:
        table = self._seqs.get(seq_id)
        if table is None or table.swapped or self._needs_cow(table, num_new_tokens):
            return None
        return blocks_for(table.num_tokens + num_new_tokens, self.block_size) - len(table.blocks)

    # -- one sequence's growth (pagedserve.memsvc.sequence_growth) ------------------------

    def _release_outside_window(self, table: BlockTable) -> None:
        sequence_growth.release_outside_window(self, table)

    def append(self, seq_id: str, new_token_ids: list[int]) -> AppendResult:
        return sequence_growth.append(self, seq_id, new_token_ids)

    def grow(self, seq_id: str, new_token_ids: list[int]) -> list[tuple[int, int]]:
        return sequence_growth.grow(self, seq_id, new_token_ids)

    def grow_running(self, seq_ids: list[str], counts: list[int], tokens: list[int],
                     fills: SteadyFills | None = None) -> RunGrowth | None:
        return grow_running(self, seq_ids, counts, tokens, fills)

    def steady_fills(self, seq_ids: list[str], positions, token_ids) -> SteadyFills | None:
        return steady_fills.check(self, seq_ids, positions, token_ids) if self.enable_prefix_caching else None

    def grow_if_fits(self, seq_id: str, new_token_ids: list[int]) -> Growth | None:
        return sequence_growth.grow_if_fits(self, seq_id, new_token_ids)

    def _extend(self, table: BlockTable, new_token_ids: list[int], needed: int, cow: bool) -> list[tuple[int, int]]:
        return sequence_growth.extend(self, table, new_token_ids, needed, cow)

    def _key_tail(self, table: BlockTable) -> None:
        """Key the full blocks of the tail, up to the first one holding a PENDING token (those
        of the prompt admitted last were computed already: pagedserve.memsvc.prompt_keys)."""
        bs, tail, keys, walked = self.block_size, table.tail_tokens, table.block_keys, self.prompt_keys
        while len(tail) >= bs:
            tokens = tail[:bs]
            if PENDING in tokens:
                return
            parent = keys[-1] if keys else None
            key = len(keys) < len(walked.keys) and walked.known(len(keys), parent, tokens, table.salt)
            key = key or block_key(parent, tokens, table.salt)
            self.unwritten.add(table, len(keys), key)
            keys.append(key)
            del tail[:bs]

    def begin_act(self, stamp: int) -> None:
        self.unwritten.stamp = stamp

    def confirm_written(self, stamps: list[int]) -> None:
        self.unwritten.confirm(stamps)

    def drop_unwritten(self, stamps: list[int] = (), seq_ids: list[str] = ()) -> None:
        self.unwritten.drop(stamps)
        self.unwritten.drop_sequences(seq_ids)

    def fill(self, seq_id: str, position: int, token_id: int) -> None:
        pending_fill.fill(self, seq_id, position, token_id)

    def fill_all(self, fills: Fills, seq_ids: list[str] | None = None) -> None:
        pending_fill.fill_all(self, fills, seq_ids)

    def fork(self, parent_id: str, child_id: str) -> None:
        sequence_fork.fork(self, parent_id, child_id)

    def free(self, seq_id: str) -> None:
        table = self._get(seq_id, on_device=False)
        if table.swapped:
            self.swap_space.free(table.host_blocks)
        else:
            self.pool.free(reversed(table.live_blocks))  # tail blocks become evictable first
        del self._seqs[seq_id]
        self.shared_tails.discard(seq_id)

    # -- swapping (pagedserve.memsvc.sequence_swap) -------------------------------------

    def can_swap_out(self, seq_id: str) -> bool:
        return sequence_swap.can_swap_out(self, seq_id)

    def swap_out(self, seq_id: str) -> list[tuple[int, int]]:
        return sequence_swap.swap_out(self, seq_id)

    def can_swap_in(self, seq_id: str) -> bool:
        return sequence_swap.can_swap_in(self, seq_id)

    def swap_in(self, seq_id: str) -> list[tuple[int, int]]:
        return sequence_swap.swap_in(self, seq_id)

    # -- measurement and checks ----------------------------------------------------------

    def snapshot(self, next_request_blocks: int | None = None) -> PoolSnapshot:
        """Paged has no external fragmentation, so `next_request_blocks` is ignored."""
        free, cached, _ = self.pool.counts()
        return paged_snapshot(
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            holders=[([None if b is None else b.block_id for b in t.blocks], t.num_tokens, t.final_len)
                     for t in self._seqs.values() if not t.swapped],
            blocks_free=free,
            blocks_cached=cached,
        )

    def check_integrity(self) -> None:
        check_paged_integrity(self)
