"""The step message: per sequence, only what changed since the executor's last step, in
columns.

The gateway's scheduler makes a `StepDelta` from memsvc's answer (pagedserve.gateway.scheduler
`on_reserved`): memsvc's grant columns as they came (ids, start positions, token counts,
block-table changes: from `table_start[i]` on, sequence i's table is its `num_new_blocks[i]`
blocks of `new_blocks`), with the tokens to compute (a token the executor sampled itself is
PENDING, pagedserve.wire.pending_token) and whether each samples. A steady decode step is such columns
where every token is PENDING (`steady_decode`: the ExecuteRequest says so in one flag). No full block table or slot mapping is built on the gateway's
side: whoever runs the model holds each sequence's state (pagedserve.step.running_set) and derives them.
`seqs[i]` is the gateway's own sequence, read only when its constant state must go
(`encode_delta`, pagedserve.step.local_engine); the gateway holds no block table: memsvc holds
the tables of record, and a sequence's whole table comes in its first grant (new, resumed,
forked) or is asked of memsvc when an executor lost its state.

`encode_delta` makes the ExecuteRequest across processes: a sequence the executor does not
hold (not in the caller's `sent`) goes with its constant state and its whole table. An
executor that answers FAILED_PRECONDITION with STATE_LOST (it restarted, or lost a
sequence) gets everything again: clear `sent` and encode the same step once more.
See docs/ARCHITECTURE.md, "The step path".
"""
from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, field
from typing import Callable

from pagedserve.wire import id_columns
from pagedserve.wire.pending_token import PENDING
from pagedserve.wire.seq_states import SeqSource, with_states
from pagedserve.wire.v1 import executor_pb2

STATE_LOST = "executor state lost"  # in FAILED_PRECONDITION details: resend every state


@dataclass
class StepDelta:
    """One step for the executor, sequence i of it: compute `num_tokens[i]` tokens of
    `token_ids` (concatenated; PENDING: the executor's own last sample) at
    `start_pos[i]`.., sample if `sample[i]` (False for a prefill chunk that does not reach
    the end of the prompt), its table from `table_start[i]` on replaced by its
    `num_new_blocks[i]` blocks of `new_blocks`. `pool_epoch`, `forget`, `step` and `copies`
    mean what they mean in pagedserve.step.step_batch.StepBatch; `stamp` is the gateway's own."""

    seq_ids: list[str] = field(default_factory=list)
    start_pos: list[int] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    sample: list[bool] = field(default_factory=list)
    table_start: list[int] = field(default_factory=list)
    num_new_blocks: list[int] = field(default_factory=list)
    new_blocks: list[int] = field(default_factory=list)
    seqs: list[SeqSource | None] = field(default_factory=list)
    pool_epoch: str = ""
    forget: list[str] = field(default_factory=list)
    step: int = 0
    copies: list[tuple[int, int]] = field(default_factory=list)
    stamp: int = 0  # the Reserve it was granted by (ReserveResult.stamp): once it ran, Plan.written
    _progress: dict | None = field(default=None, init=False, repr=False, compare=False)

    def num_seqs(self) -> int:
        return len(self.seq_ids)

    def sampled_ids(self) -> list[str]:
        """The sequences that sample, in step order (the executor's outputs follow it)."""
        return list(itertools.compress(self.seq_ids, self.sample))

    def progress(self) -> dict[str, tuple[int, bool]]:
        """seq id -> (its position once this step ran, whether the step samples it); made
        once (the plan made ahead of this step and the answer to it both read it)."""
        if self._progress is None:
            ends = map(operator.add, self.start_pos, self.num_tokens)
            self._progress = dict(zip(self.seq_ids, zip(ends, self.sample)))
        return self._progress


def steady_decode(step: StepDelta) -> bool:
    """Whether every sequence computes one token, the executor's own last sample, and samples
    (the ExecuteRequest says `decode` and leaves those columns empty)."""
    b = len(step.seq_ids)
    return (b > 0 and len(step.token_ids) == b and step.token_ids.count(PENDING) == b
            and step.num_tokens.count(1) == b and False not in step.sample)


def fed_and_known(step: StepDelta) -> tuple[list[bool], list[int]]:
    """The ExecuteRequest's `fed` column and its token_ids (the PENDING ones left out)."""
    tokens = step.token_ids
    n = tokens.count(PENDING)
    if n == 0:
        return [], tokens
    if n == len(tokens) == len(step.seq_ids):  # a steady decode step
        return [True] * n, []
    fed, known, at = [], [], 0
    for k in step.num_tokens:
        own = tokens[at] == PENDING
        fed.append(own)
        if not own:
            known += tokens[at:at + k]
        at += k
    return fed, known


def encode_delta(step: StepDelta, sent: set[str], session_id: str, incarnation: str,
                 tables: Callable[[list[str]], list[list[int]]] | None = None) -> executor_pb2.ExecuteRequest:
    """The ExecuteRequest for `step` against `sent`, the ids whose state the executor holds
    (as far as the caller knows); adds the ids whose state goes now and drops `forget`'s.
    A sequence that goes with its state while the step holds only a change to its table
    goes with its whole table, asked of memsvc (`tables`: MemoryClient.tables): that table
    may be ahead of this step's (a step planned ahead is reserved by then), which is
    harmless, as a later step's change replaces the blocks from its `table_start` on."""
    forget = step.forget
    for seq_id in forget:
        sent.discard(seq_id)
    ids = step.seq_ids
    tstarts, nnew, newb = step.table_start, step.num_new_blocks, step.new_blocks
    states = []
    if not sent.issuperset(ids):  # some states must go, with their whole tables
        states, tstarts, nnew, newb = with_states(step, sent, tables)
    ids, joined = id_columns.join_ids(ids)
    if steady_decode(step):  # its num_tokens, token_ids, sample and fed columns go as one flag
        columns = {"decode": True}
    else:
        fed, tokens = fed_and_known(step)
        columns = {"num_tokens": step.num_tokens, "token_ids": tokens, "sample": step.sample, "fed": fed}
    return executor_pb2.ExecuteRequest(
        pool_epoch=step.pool_epoch, session_id=session_id, incarnation=incarnation,
        forget=forget, seq_ids=ids, joined_seq_ids=joined, start_pos=step.start_pos,
        table_start=tstarts, num_new_blocks=nnew, new_blocks=newb, states=states, step=step.step,
        copy_src=[c[0] for c in step.copies], copy_dst=[c[1] for c in step.copies], **columns)
