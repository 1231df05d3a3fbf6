"""The step message: per sequence, only what changed since the executor's last step.

The gateway's scheduler makes a `StepDelta` from memsvc's answer (gateway.scheduler
`on_reserved`): for each sequence, the tokens to compute at `start_pos` (a decode token the
executor sampled itself is PENDING, wire.step_feed), whether it samples, and the change to its
block table that memsvc granted (`table_start`, `new_blocks`). No full block table or slot
mapping is built on the gateway's side: whoever runs the model holds each sequence's state
(wire.held_seqs) and derives them. `seq` is the gateway's own sequence, read only when the
state must go again (`encode_delta`, wire.ordered_executor).

The steady decode step, where every sequence computes the token it sampled last step,
comes as a `FedRun` in columns instead: memsvc's column answer, passed on as it came
(gateway.scheduler `_fed_run`); `all_seqs` gives it one SeqDelta per sequence where a
reader needs them.

`encode_delta` makes the ExecuteRequest across processes: a sequence the executor does not
hold (not in the caller's `sent`) goes with its constant state and its whole table. An
executor that answers FAILED_PRECONDITION with STATE_LOST (it restarted, or lost a
sequence) gets everything again: clear `sent` and encode the same step once more.
See docs/ARCHITECTURE.md, "The step path".
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Protocol

from wire import convert
from wire.pending_token import PENDING
from wire.protocol import SamplingParams
from wire.v1 import executor_pb2

STATE_LOST = "executor state lost"  # in FAILED_PRECONDITION details: resend every state


class SeqSource(Protocol):
    """What the step message reads from the gateway's sequence when its state must go."""

    sampling: SamplingParams
    seed: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    block_table: list[int]


@dataclass(slots=True)
class SeqDelta:
    seq_id: str
    token_ids: list[int]  # to compute at start_pos..; [PENDING]: the executor's own last sample
    start_pos: int
    sample: bool  # False for a prefill chunk that does not reach the end of the prompt
    table_start: int  # the block table from this index on is new_blocks
    new_blocks: list[int]
    seq: SeqSource | None = None


@dataclass
class FedRun:
    """Sequences that each compute the one token they sampled last step (PENDING) and sample,
    in columns: sequence i computes at `start_pos[i]`, and its table from `table_start[i]`
    on is its `num_new_blocks[i]` blocks of `new_blocks` (memsvc's column answer passed
    on as it came). `seqs`: the gateway's sequences, read as SeqDelta.seq is."""

    seq_ids: list[str]
    start_pos: list[int]
    table_start: list[int]
    num_new_blocks: list[int]
    new_blocks: list[int]
    seqs: list[SeqSource]

    def deltas(self) -> list[SeqDelta]:
        out, at = [], 0
        for seq_id, start, table_start, k, seq in zip(self.seq_ids, self.start_pos, self.table_start,
                                                      self.num_new_blocks, self.seqs):
            out.append(SeqDelta(seq_id, [PENDING], start, True, table_start, self.new_blocks[at:at + k], seq))
            at += k
        return out


@dataclass
class StepDelta:
    """One step for the executor: `seqs`, then `run` (in columns, the steady decode step's
    sequences). `pool_epoch`, `forget`, `step` and `copies` mean what they mean in
    wire.protocol.StepBatch; `stamp` is the gateway's own."""

    seqs: list[SeqDelta]
    pool_epoch: str = ""
    forget: list[str] = field(default_factory=list)
    step: int = 0
    run: FedRun | None = None
    copies: list[tuple[int, int]] = field(default_factory=list)
    stamp: int = 0  # the Reserve it was granted by (ReserveResult.stamp): once it ran, Plan.written
    _progress: dict | None = field(default=None, init=False, repr=False, compare=False)

    def all_seqs(self) -> list[SeqDelta]:
        """Every sequence as a SeqDelta (the run's made now), in step order."""
        return self.seqs if self.run is None else self.seqs + self.run.deltas()

    def num_seqs(self) -> int:
        return len(self.seqs) + (len(self.run.seq_ids) if self.run is not None else 0)

    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs) + (len(self.run.seq_ids) if self.run is not None else 0)

    def seq_ids(self) -> list[str]:
        ids = [s.seq_id for s in self.seqs]
        return ids + self.run.seq_ids if self.run is not None else ids

    def sampled_ids(self) -> list[str]:
        """The sequences that sample, in step order (the executor's outputs follow it)."""
        ids = [s.seq_id for s in self.seqs if s.sample]
        return ids + self.run.seq_ids if self.run is not None else ids

    def progress(self) -> dict[str, tuple[int, bool]]:
        """seq id -> (its position once this step ran, whether the step samples it); made
        once (the plan made ahead of this step and the answer to it both read it)."""
        if self._progress is None:
            out = {s.seq_id: (s.start_pos + len(s.token_ids), s.sample) for s in self.seqs}
            run = self.run
            if run is not None:
                out.update(zip(run.seq_ids, zip(map((1).__add__, run.start_pos), itertools.repeat(True))))
            self._progress = out
        return self._progress


def encode_delta(step: StepDelta, sent: set[str], session_id: str, incarnation: str
                 ) -> executor_pb2.ExecuteRequest:
    """The ExecuteRequest for `step` against `sent`, the ids whose state the executor holds
    (as far as the caller knows); adds the ids whose state goes now and drops `forget`'s.
    A sequence's whole table is read from `seq.block_table` when it goes with its state
    and the delta does not hold the whole table: that table may be ahead of this step's
    (a step planned ahead is reserved by then), which is harmless, as a later step's change
    replaces the blocks from its `table_start` on."""
    forget = step.forget
    for seq_id in forget:
        sent.discard(seq_id)
    run = step.run
    seqs = step.seqs
    if run is not None and not sent.issuperset(run.seq_ids):  # a state must go: one by one
        seqs, run = step.all_seqs(), None
    ids, starts, ntok, toks, samples, tstarts, nnew, newb, states = [], [], [], [], [], [], [], [], []
    fed: list[bool] = []
    any_fed = False
    sampling: dict[int, object] = {}
    for d in seqs:
        seq_id, tstart, new = d.seq_id, d.table_start, d.new_blocks
        if seq_id not in sent:
            seq = d.seq
            if seq is None:
                raise ValueError(f"sequence {seq_id}: its state must go, but the step does not carry it")
            sp = seq.sampling
            proto = sampling.get(id(sp))
            if proto is None:
                proto = sampling[id(sp)] = convert.sampling_to_proto(sp)
            prompt = seq.prompt_token_ids
            if sp.uses_penalties:
                history, prompt_len = (prompt + seq.output_token_ids)[:d.start_pos], len(prompt)
            else:
                history, prompt_len = [], 0
            states.append(executor_pb2.SeqState(
                seq_id=seq_id, sampling=proto, seed=seq.seed, prompt_len=prompt_len, history=history,
                prompt=prompt if sp.prompt_logprobs is not None else None))
            if tstart:
                tstart, new = 0, list(seq.block_table)
            sent.add(seq_id)
        ids.append(seq_id)
        starts.append(d.start_pos)
        tokens = d.token_ids
        ntok.append(len(tokens))
        own = tokens[0] == PENDING
        fed.append(own)
        if own:
            any_fed = True
        else:
            toks.extend(tokens)
        samples.append(d.sample)
        tstarts.append(tstart)
        nnew.append(len(new))
        newb.extend(new)
    if run is not None:  # the executor holds every state: the columns go as they are
        n = len(run.seq_ids)
        ids += run.seq_ids
        starts += run.start_pos
        ntok += [1] * n
        samples += [True] * n
        tstarts += run.table_start
        nnew += run.num_new_blocks
        newb += run.new_blocks
        fed += [True] * n
        any_fed = any_fed or n > 0
    return executor_pb2.ExecuteRequest(
        pool_epoch=step.pool_epoch, session_id=session_id, incarnation=incarnation,
        forget=forget, seq_ids=ids, start_pos=starts, num_tokens=ntok, token_ids=toks,
        sample=samples, table_start=tstarts, num_new_blocks=nnew, new_blocks=newb, states=states,
        fed=fed if any_fed else (), step=step.step,
        copy_src=[c[0] for c in step.copies], copy_dst=[c[1] for c in step.copies])
