"""KVAllocator: what the scheduler sees of the KV pool, whatever the allocation policy.

Check/act pairs: `admit` / `add_sequence`, `can_append` / `append`. An act that lacks
space raises NoFreeBlocks and changes nothing, so a scheduler may also try and catch.
`grow_if_fits` is the check and the act of one running sequence's step in one call.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from pagedserve.memsvc.accounting import PoolSnapshot
from pagedserve.memsvc.admission import Admission
from pagedserve.memsvc.block_pool import NoFreeBlocks
from pagedserve.wire.reserve_messages import Fills

__all__ = ["POLICIES", "AppendResult", "Growth", "KVAllocator", "NoFreeBlocks"]

POLICIES: tuple[str, ...] = ("paged", "contiguous-max", "contiguous-pow2", "contiguous-oracle")

# what `grow_if_fits` returns: (tokens before, copies as `grow` returns them, *table_changes)
Growth = tuple[int, list[tuple[int, int]], int, list[int]]
# what `grow_running` returns: (start_pos, table_start, num_new_blocks, new_blocks) columns
RunGrowth = tuple[list[int], list[int], list[int], list[int]]


@dataclass
class AppendResult:
    """slot_mapping: one slot per appended token, in order (slot = block * block_size +
    offset). copies: (src_block, dst_block) pairs the caller must copy BEFORE writing the
    new tokens (copy-on-write of a shared partial last block)."""

    slot_mapping: list[int] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if any(s < 0 for s in self.slot_mapping):
            raise ValueError("slots must be >= 0")
        for src, dst in self.copies:
            if src == dst:
                raise ValueError(f"a copy from block {src} onto itself")


class KVAllocator(ABC):
    """Block tables over a pool of `num_blocks` blocks of `block_size` token slots.

    `supports_swap`: the allocator also has a host swap space and implements `is_swapped`,
    `can_swap_out` / `swap_out` and `can_swap_in` / `swap_in` (pagedserve.memsvc.paged_allocator)."""

    block_size: int
    num_blocks: int
    supports_swap: bool = False

    @abstractmethod
    def admit(
        self,
        prompt_token_ids: list[int],
        max_len: int,
        salt: str | None = None,
        *,
        final_len: int | None = None,
        use_cache: bool = True,
    ) -> Admission:
        """yes / wait / never for a new request; `max_len` = prompt + max_tokens, already
        capped at the model maximum. `final_len` (optional) sizes the contiguous-oracle
        reservation; other policies ignore it. `use_cache=False`: as if nothing of the
        prompt were cached (add_sequence will attach nothing). Pure: changes nothing,
        counts no queries."""

    @abstractmethod
    def add_sequence(
        self,
        seq_id: str,
        prompt_token_ids: list[int],
        *,
        max_len: int,
        final_len: int | None = None,
        salt: str | None = None,
        use_cache: bool = True,
    ) -> int:
        """Register a sequence; return how many prompt tokens are already cached (the first
        `append` starts right after them). `final_len` is for measurement only (and sizes
        the contiguous-oracle reservation). `use_cache=False`: attach no cached block, the
        whole prompt is computed (its blocks are still cached for later sequences).
        ValueError if `seq_id` is already registered."""

    @abstractmethod
    def num_new_blocks(self, seq_id: str, num_new_tokens: int) -> int:
        """Blocks `append` of `num_new_tokens` would take from the free pool (COW included)."""

    def can_append(self, seq_id: str, num_new_tokens: int) -> bool:
        return self.num_new_blocks(seq_id, num_new_tokens) <= self.num_free_blocks()

    def needs_copy(self, seq_id: str, num_new_tokens: int) -> bool:
        """`append` of `num_new_tokens` would copy a block first (copy-on-write)."""
        return False

    @abstractmethod
    def append(self, seq_id: str, new_token_ids: list[int]) -> AppendResult:
        """Give slots to the sequence's next len(new_token_ids) tokens (their ids key blocks
        that become full, for prefix caching; a PENDING id keys nothing until `fill`).
        NoFreeBlocks if space is missing."""

    def grow(self, seq_id: str, new_token_ids: list[int]) -> list[tuple[int, int]]:
        """`append` for a caller that needs no slot mapping: only the copies to make."""
        return self.append(seq_id, new_token_ids).copies

    def grow_if_fits(self, seq_id: str, new_token_ids: list[int]) -> Growth | None:
        """Check and act at once for a running sequence: None, with nothing changed, when it
        is swapped out or `can_append` says no; otherwise (tokens before, `grow`'s copies,
        *`table_changes`). Allocators may do it in fewer lookups; this is the reference."""
        if self.supports_swap and self.is_swapped(seq_id) or not self.can_append(seq_id, len(new_token_ids)):
            return None
        start = self.num_tokens(seq_id)
        copies = self.grow(seq_id, new_token_ids)
        return (start, copies, *self.table_changes(seq_id))

    def growth_as_is(self, seq_id: str, num_new_tokens: int) -> int | None:
        """The blocks a running sequence takes to grow by `num_new_tokens` with no copy
        (held, not swapped out, no copy-on-write), or None where it cannot grow so. This is
        the reference; allocators may do it in one lookup."""
        if (not self.has_sequence(seq_id) or self.supports_swap and self.is_swapped(seq_id)
                or self.needs_copy(seq_id, num_new_tokens)):
            return None
        return self.num_new_blocks(seq_id, num_new_tokens)

    def grow_running(self, seq_ids: list[str], counts: list[int], tokens: list[int],
                     fills=None) -> RunGrowth | None:
        """Every running sequence of a plan at once, in order (`counts[i]` of `tokens` for
        `seq_ids[i]`): (start_pos, table_start, num_new_blocks, new_blocks), the columns of
        what `grow_if_fits` gives each, where all are held, none is swapped out or copies,
        and all fit; None, with nothing changed, otherwise or where an allocator has no such
        path (the caller goes one sequence at a time, the reference). `fills`: what
        `steady_fills` answered for these sequences, applied first (not where it answers
        None: the caller applies them then)."""
        return None

    def steady_fills(self, seq_ids: list[str], positions, token_ids):
        """Where fill i (`positions[i]`, `token_ids[i]`) is the id of the PENDING last token
        of `seq_ids[i]`, each held on the device: those fills, checked, for `grow_running`
        to apply in its pass (pagedserve.memsvc.steady_fills); None, with nothing changed,
        otherwise or where an allocator has no such path (the caller uses `fill_all`)."""
        return None

    def take_copies(self) -> list[tuple[str, int, int]]:
        """Copies the last acts decided on their own, in order, since the last call:
        (kind, src, dst) with kind "offload" (pool -> host tier, of a block an allocation
        evicted) or "restore" (host tier -> pool, of a prefix hit). The caller performs them
        in that order, before any copy the acts returned. None without a host tier."""
        return []

    def begin_act(self, stamp: int) -> None:
        """The acts from here on belong to the Reserve stamped `stamp`: the blocks they key
        wait for `confirm_written` before they are prefix-cache hits
        (pagedserve.memsvc.unwritten_keys). Policies without a prefix cache key nothing."""

    def confirm_written(self, stamps: list[int]) -> None:
        """The steps of these Reserves ran: their keyed blocks become prefix-cache hits."""

    def drop_unwritten(self, stamps: list[int] = (), seq_ids: list[str] = ()) -> None:
        """The steps of these Reserves, or these sequences' steps since their last confirmed
        one, did not run: their blocks' keys are dropped, never to be hits."""

    def fill(self, seq_id: str, position: int, token_id: int) -> None:
        """The id of the PENDING token at `position`; ValueError if none is pending there.
        Policies without a prefix cache keep no ids: nothing to do."""

    def fill_all(self, fills: Fills, seq_ids: list[str] | None = None) -> None:
        """`fill` of each (seq_id, position, token_id) in order, a sequence no longer held
        skipped; `seq_ids`: the ids to read them under where not their own (a session's)."""
        if seq_ids is None:
            seq_ids = fills.seq_ids
        for seq_id, position, token_id in zip(seq_ids, fills.positions, fills.token_ids):
            if self.has_sequence(seq_id):
                self.fill(seq_id, position, token_id)

    @abstractmethod
    def fork(self, parent_id: str, child_id: str) -> None:
        """`child_id` shares every block of `parent_id`; nothing is allocated."""

    @abstractmethod
    def free(self, seq_id: str) -> None:
        """Release every block of the sequence; KeyError for an unknown id."""

    @abstractmethod
    def has_sequence(self, seq_id: str) -> bool: ...

    @abstractmethod
    def sequence_ids(self) -> list[str]:
        """Registered sequences (swapped-out ones included), in registration order."""

    @abstractmethod
    def block_table(self, seq_id: str) -> list[int]:
        """Block ids holding the sequence's tokens, in position order."""

    def table_changes(self, seq_id: str) -> tuple[int, list[int]]:
        """(start, blocks): the sequence's block table from index `start` on, where it
        changed since the last call for it (the whole table the first time, after a swap-in
        or ...); what a Grant carries. This default always says the whole table."""
        return 0, self.block_table(seq_id)

    @abstractmethod
    def num_tokens(self, seq_id: str) -> int:
        """Tokens that have slots (a cached prefix included)."""

    @abstractmethod
    def num_free_blocks(self) -> int:
        """Blocks an allocation could take now (free plus evictable cached)."""

    @abstractmethod
    def snapshot(self, next_request_blocks: int | None = None) -> PoolSnapshot:
        """Where the pool's slots go now; see pagedserve.memsvc.accounting."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Raise IntegrityError naming the first broken invariant."""

