"""The running set: the executor's mirror of its running sequences, as arrays that each step
changes in place.

Row r holds one sequence: its block table (`tables[r, :table_len[r]]`, the only copy outside
memsvc), its last sampled token and that token's position (the feed: a step may compute
"the token you sampled last", PENDING in the step message), its sampling parameters as
columns, and its constant state (`Held`). `apply` takes one step's columns (ids, start
positions, token counts, the tokens not fed, table changes: pagedserve.step.table_changes)
and makes the StepBatch with array operations over the batch (pagedserve.step.general_apply) (a bool column is tested with
count_nonzero, lighter than a ufunc reduction at this size); only rows that keep a token
history are visited one by one. `apply_decode` makes the batch of a steady decode step (every
row fed one token, every row sampling) with fewer of them. `fill` puts the fed tokens in place
just before the pass, `record` keeps what it sampled. A steady decode step takes shortcuts
(the last step's rows kept while no row changes hands, pagedserve.step.step_rows; every row
fed; every row reporting) that give what the general path gives (`fast=False` takes none: the
tests compare the two). Rows taken and let go: pagedserve.step.running_rows. See
docs/ARCHITECTURE.md, "One step".
"""
from __future__ import annotations

import numpy as np

from pagedserve.step import general_apply, running_feed, running_rows, table_changes
from pagedserve.step.step_batch import FLAG_HISTORY, FLAG_INVALID, Held, StepBatch
from pagedserve.step.step_rows import StepRows
from pagedserve.wire.pending_token import PENDING
from pagedserve.wire.step_delta import STATE_LOST


class StateLost(LookupError):
    """The step relies on state this executor does not hold."""


class Applied:
    """A step made from the running set: the batch, and the rows it came from."""

    __slots__ = ("batch", "rows", "gens", "fed", "owners", "decode")

    def __init__(self, batch: StepBatch, rows: np.ndarray, gens: np.ndarray, fed: np.ndarray, owners: int = -1,
                 decode: bool = False):
        self.batch, self.rows, self.gens, self.fed = batch, rows, gens, fed
        self.owners = owners  # RunningSet._owners when it was made: no row changed hands since while equal
        self.decode = decode  # made by apply_decode: every row fed one token, every row sampling


class RunningSet:
    def __init__(self, block_size: int, rows: int = 64, width: int = 32, fast: bool = True):
        self.block_size = block_size
        self.fast = fast  # False: no step takes a shortcut (tests check that both agree)
        self.row_of: dict[str, int] = {}
        self.held: list[Held | None] = [None] * rows
        self.free = list(range(rows - 1, -1, -1))
        self.tables = np.zeros((rows, width), dtype=np.int32)
        self.table_len = np.zeros(rows, dtype=np.int32)
        self.last_pos = np.full(rows, -1, dtype=np.int64)
        self.last_token = np.zeros(rows, dtype=np.int64)
        self.feed_src = np.full(rows, -1, dtype=np.int64)  # >= 0: last_token is still on the device, there
        self.unsettled = None  # (PendingOutputs, rows, their entries): see pagedserve.step.running_feed
        self.gen = np.zeros(rows, dtype=np.int64)  # a row's owner changes: a step's record skips it
        self.flags = np.zeros(rows, dtype=np.uint8)
        self.temperature = np.ones(rows, dtype=np.float32)  # 1 for greedy rows
        self.top_k = np.zeros(rows, dtype=np.int64)
        self.top_p = np.ones(rows, dtype=np.float32)
        self.min_p = np.zeros(rows, dtype=np.float32)
        self.left_out: dict[str, str] = {}  # seq id -> why the executor left it out of a step
        self._gen = 0
        self._owners = 0  # counts rows given to a sequence or taken from one
        self._checked = (None, 0, "")  # the last sampling parameters checked: (them, flags, error)
        self._last: StepRows | None = None  # the last step's: see `_rows`
        self.tables_version = 0  # counts changes to `tables` and `table_len` (StepRows.tables)

    def __len__(self) -> int:
        return len(self.row_of)

    def admit(self, seq_id: str, sampling, seed: int, prompt_len: int = 0, history: list[int] | None = None,
              prompt: list[int] | None = None, table: list[int] | None = None) -> int:
        """Hold a sequence (again: its state and table replaced, its last sample kept)."""
        return running_rows.admit(self, seq_id, sampling, seed, prompt_len, history, prompt, table)

    def forget(self, seq_ids) -> None:
        running_rows.forget(self, seq_ids)

    def _rows(self, ids: list[str]) -> StepRows:
        """The rows of `ids`; StateLost for an id not held. The last step's are kept until
        a row changes hands, as most steps name the same ids."""
        last = self._last
        if last is not None and self.fast and last.ids == ids:
            return last
        try:
            rows = list(map(self.row_of.__getitem__, ids))
        except KeyError as e:
            raise StateLost(f"{STATE_LOST}: sequence {e.args[0]!r} is unknown to this executor: "
                            "send its state") from None
        self._last = StepRows(self, ids[:], rows)
        return self._last

    def apply(self, seq_ids: list[str], start_pos, num_tokens, tokens, fed, sample, table_start,
              num_new_blocks, new_blocks, **batch_fields) -> Applied:
        """The StepBatch of one step's columns; its table changes applied
        (pagedserve.step.general_apply: any step; `apply_decode`: a steady decode step's)."""
        return general_apply.apply(self, seq_ids, start_pos, num_tokens, tokens, fed, sample, table_start,
                                   num_new_blocks, new_blocks, **batch_fields)

    def apply_decode(self, seq_ids: list[str], start_pos, table_start, num_new_blocks, new_blocks,
                     **batch_fields) -> Applied:
        """`apply` of a steady decode step, in fewer array operations: every sequence computes
        one token, the one this set sampled for it last (fed), and samples; the same batch
        and errors as `apply` with num_tokens and sample all 1, every row fed, no tokens."""
        ids, at, start, tstart, nnew = self._columns(seq_ids, start_pos, table_start, num_new_blocks)
        rows, b = at.rows, len(ids)
        if b and start.min() < 0:
            i = int(np.flatnonzero(start < 0)[0])
            raise ValueError(f"sequence {ids[i]}: 1 tokens at position {start[i]}: "
                             "a step computes at least one token at a position >= 0")
        lens, tables = at.tables(self)
        if table_changes.changes(lens, tstart, nnew, new_blocks):
            table_changes.change(self, ids, rows, tstart, nnew, new_blocks)
            lens, tables = at.tables(self)
        token_ids = np.empty(b, dtype=np.int64)
        token_ids.fill(PENDING)
        slots = self._decode_slots(ids, rows, start, lens)
        ones, sample, fed = at.decode_columns()
        applied = self._applied(ids, at, start, ones, token_ids, sample, slots, tables.copy(), lens, fed,
                                batch_fields)
        applied.decode = True
        return applied

    def _columns(self, seq_ids, start_pos, table_start, num_new_blocks, more=()):
        """(ids, their rows, start, table_start, num_new_blocks as arrays): the columns every
        step has, each as long as the ids, as are the arrays in `more` (one, or a tuple)."""
        ids = list(seq_ids)
        at, b = self._rows(ids), len(ids)
        start = np.asarray(start_pos, dtype=np.int64)
        tstart = np.asarray(table_start, dtype=np.int64)
        nnew = np.asarray(num_new_blocks, dtype=np.int64)
        more = more if isinstance(more, tuple) else (more,)
        if len(start) != b or len(tstart) != b or len(nnew) != b or any(len(c) != b for c in more):
            raise ValueError(f"{b} sequences, but the step's columns have other lengths")
        return ids, at, start, tstart, nnew

    def _decode_slots(self, ids: list[str], rows: np.ndarray, start: np.ndarray, lens: np.ndarray) -> np.ndarray:
        """The slot of each row's one token at `start`."""
        bs = self.block_size
        index, slots = np.divmod(start, bs)
        short = index >= lens
        if np.count_nonzero(short):
            i = int(np.flatnonzero(short)[0])
            self._short(ids, i, lens, int(start[i] + 1))
        slots += self.tables[rows, index] * np.int64(bs)
        return slots

    def _short(self, ids: list[str], i: int, lens: np.ndarray, end: int):
        bs = self.block_size
        raise ValueError(f"sequence {ids[i]}: {lens[i]} blocks in its table, {-(-end // bs)} needed for {end} tokens")

    def _applied(self, ids: list[str], at: StepRows, start, n, token_ids, sample, slots, tables, lens, fed_i,
                 batch_fields: dict) -> Applied:
        batch = StepBatch(ids, start, n, token_ids, sample, slots, tables, lens, list(at.held), at.flags,
                          temperature=at.temperature, top_k=at.top_k, top_p=at.top_p, min_p=at.min_p, **batch_fields)
        batch._some = at.some  # its some_flags, made once for the rows
        if at.some & FLAG_HISTORY:
            self._histories(batch)
        if at.some & FLAG_INVALID:
            for i in np.flatnonzero(at.flags & FLAG_INVALID):
                batch.errors[int(i)] = at.held[i].error
        return Applied(batch, at.rows, at.gen, fed_i, self._owners)

    @staticmethod
    def _histories(batch: StepBatch) -> None:
        for i in np.flatnonzero(batch.flags & FLAG_HISTORY):
            h = batch.held[i]
            s = int(batch.start_pos[i])
            history = h.history
            del history[s:]
            history.extend(batch.tokens_of(i).tolist())
            pl = h.prompt_len
            batch.histories[int(i)] = (history[:pl], history[pl:])

    def fill(self, step: Applied) -> None:
        """Put each fed token in place (and in the token histories); FedTokenUnknown, before
        any change, for one this set does not hold. A sequence left out of an earlier step
        is left out of this one too, with the same reason."""
        running_feed.fill(self, step)

    def record(self, step: Applied, outputs) -> None:
        """Keep what the step sampled (`outputs`: one per row that reports, in order;
        pagedserve.wire.step_outputs, or still on the device: pagedserve.wire.pending_outputs)."""
        running_feed.record(self, step, outputs)
