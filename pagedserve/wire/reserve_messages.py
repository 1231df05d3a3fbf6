"""The Reserve call's messages: the gateway's plan for a step (`Plan`, new sequences as
`PlanEntry`s, running ones and `Fills` as columns) and memsvc's answer (`ReserveResult`: `Grants` as
columns, preemptions, rejections). Their protobuf twins are in memory.proto; the step they
make is docs/ARCHITECTURE.md's "One step".
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


@dataclass
class PlanEntry:
    """A new sequence asking memsvc for slots: its whole prompt in `token_ids`; memsvc
    matches it against the prefix cache and grants up to `max_new_tokens` of the rest.
    (`new=False`: a running sequence's tokens, for in-process callers: Plan moves it into
    its columns.)"""

    seq_id: str
    token_ids: list[int]
    new: bool = True
    max_len: int = 0  # prompt + max_tokens, capped at the model maximum
    max_new_tokens: int = 0  # cap on the tokens granted this step
    final_len: int | None = None  # known final length, for measurement only
    salt: str | None = None
    skip_prefix_cache: bool = False  # attach no cached blocks (prompt logprobs need every
    # position computed); the blocks it computes are still cached for others


@dataclass
class Fills:
    """The ids of tokens an earlier plan sent as PENDING, in columns: sequence `seq_ids[i]`
    has token `token_ids[i]` at `positions[i]`. Iterates as (seq_id, position, token_id)."""

    seq_ids: list[str] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, fills) -> Fills:
        """`fills`: (seq_id, position, token_id) triples."""
        fills = list(fills)
        return cls(*map(list, zip(*fills))) if fills else cls()

    def __len__(self) -> int:
        return len(self.seq_ids)

    def __iter__(self):
        return zip(self.seq_ids, self.positions, self.token_ids)


@dataclass
class Plan:
    """One step's request to memsvc, in priority order: the running sequences (swapped-out
    ones to resume among them) in columns, `run_ids[i]` computing the next `run_counts[i]`
    tokens of `run_tokens`, then the new ones in `entries`. In a plan made ahead
    (`ahead`), a running sequence's tokens may end with PENDING (pagedserve.wire.pending_token): the
    one the running step samples, its id named by a later plan's `fills`.
    `step_tokens` / `step_seconds` report the previous step (tokens computed, wall
    seconds of the executor's Execute): memsvc learns the cost of recompute from them.

    `ahead`: made while the executor still runs the previous step. memsvc then grants it
    only if that needs no block copy and no preemption (it would touch blocks the running
    step uses): otherwise it applies only `fills` and `free` and answers `deferred`, and
    the gateway plans again once the step is done. A plan made ahead carries no forks.
    `fills`: the ids of tokens an earlier plan sent as PENDING, applied before anything
    else (prefix-cache keys of the blocks they complete); in-process callers may give
    (seq_id, position, token_id) triples, which Plan moves into `Fills` columns.

    What the session's earlier steps did, settled before anything else (a block keyed by a
    Reserve is a prefix-cache hit only once its step is known to have run): `written`, the
    stamp (ReserveResult.stamp) of the last step that ran, every step reserved before it
    having run too; `void`, the steps reserved after it will never run (a step failed);
    `failed`, sequences left out of steps that ran (their writes did not happen)."""

    entries: list[PlanEntry] = field(default_factory=list)
    free: list[str] = field(default_factory=list)  # finished or cancelled: release their blocks first
    step_tokens: int = 0
    step_seconds: float = 0.0
    forks: list[tuple[str, str]] = field(default_factory=list)  # (parent, child), done before
    # anything else: the child shares every block of the parent (copy-on-write from here on)
    ahead: bool = False
    fills: Fills = field(default_factory=Fills)
    written: int = 0
    void: bool = False
    failed: list[str] = field(default_factory=list)
    run_ids: list[str] = field(default_factory=list)
    run_counts: list[int] = field(default_factory=list)
    run_tokens: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not isinstance(self.fills, Fills):
            self.fills = Fills.of(self.fills)
        running = [e for e in self.entries if not e.new]
        if running:
            self.entries = [e for e in self.entries if e.new]
            for e in running:
                self.run_ids.append(e.seq_id)
                self.run_counts.append(len(e.token_ids))
                self.run_tokens.extend(e.token_ids)

    def seq_ids(self) -> list[str]:
        """Every sequence the plan asks for, in plan order."""
        return self.run_ids + [e.seq_id for e in self.entries]

    def empty(self) -> bool:
        return not (self.run_ids or self.entries or self.free or self.forks or self.fills)


class Grant(NamedTuple):
    """One sequence's grant, read out of Grants (tests and reports read them so)."""

    seq_id: str
    start_pos: int
    num_tokens: int
    table_start: int = 0
    new_blocks: list[int] = ()
    num_cached_tokens: int = 0


@dataclass
class Grants:
    """memsvc's grants in columns: sequence `seq_ids[i]` has slots for `num_tokens[i]`
    tokens from `start_pos[i]`, and its block table from index `table_start[i]` on is now
    its `num_new_blocks[i]` blocks of `new_blocks` (a new or resumed sequence: the whole
    table from 0; a decode step that fills no new block: nothing); `num_cached[i]`: prompt
    tokens a new sequence found in the prefix cache. The slot of position p is
    table[p // block_size] * block_size + p % block_size. The step message
    (pagedserve.wire.step_delta) takes these columns as they are."""

    seq_ids: list[str] = field(default_factory=list)
    start_pos: list[int] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    table_start: list[int] = field(default_factory=list)
    num_new_blocks: list[int] = field(default_factory=list)
    new_blocks: list[int] = field(default_factory=list)
    num_cached: list[int] = field(default_factory=list)

    def add(self, seq_id: str, start: int, n: int, table_start: int, new_blocks: list[int],
            cached: int = 0) -> None:
        self.seq_ids.append(seq_id)
        self.start_pos.append(start)
        self.num_tokens.append(n)
        self.table_start.append(table_start)
        self.num_new_blocks.append(len(new_blocks))
        self.new_blocks.extend(new_blocks)
        self.num_cached.append(cached)

    def check(self) -> None:
        """ValueError where the columns do not agree in length."""
        lengths = {len(c) for c in (self.seq_ids, self.start_pos, self.num_tokens, self.table_start,
                                    self.num_new_blocks, self.num_cached)}
        if len(lengths) > 1 or sum(self.num_new_blocks) != len(self.new_blocks):
            raise ValueError("the grant columns (seq_ids, start_pos, num_tokens, table_start, "
                             "num_new_blocks, num_cached, new_blocks) do not agree")

    def __len__(self) -> int:
        return len(self.seq_ids)

    def __iter__(self):
        at = 0
        for i, k in enumerate(self.num_new_blocks):
            yield Grant(self.seq_ids[i], self.start_pos[i], self.num_tokens[i], self.table_start[i],
                        self.new_blocks[at:at + k], self.num_cached[i])
            at += k

    def __getitem__(self, i: int) -> Grant:
        return list(self)[i]


@dataclass
class Preemption:
    seq_id: str
    mode: str  # "recompute" (blocks freed) or "swap" (blocks moved to host; resume later)


@dataclass
class Rejection:
    seq_id: str
    reason: str  # says which limit the request exceeds


@dataclass
class ReserveResult:
    grants: Grants = field(default_factory=Grants)
    preempted: list[Preemption] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)
    waiting: list[str] = field(default_factory=list)  # new sequences that fit later, not now
    resumed: list[str] = field(default_factory=list)  # swapped-out sequences back on the device
    pool_epoch: str = ""  # the pool the grants are in: new with every memsvc process
    deferred: bool = False  # a plan made ahead that memsvc did not grant (see Plan.ahead)
    # (src, dst) copy-on-write copies for ranks that hold their own pools (memsvc copied its
    # own already): they travel with this step to the executor (StepBatch.copies)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    stamp: int = 0  # names this Reserve in a later plan's `written`
