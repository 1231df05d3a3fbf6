"""The general path of `Scheduler.on_reserved`: memsvc's answer made the step to run.
`reject` ends the new sequences memsvc can never fit; `sequences` finds the sequence of each
grant, None where it ended since a plan made ahead (its id maybe reused by a new request);
`without_ended` leaves those out (memsvc frees them next); `tokens` fills the step's token
and sample columns and admits the new sequences granted (a token the running step samples
is PENDING, pagedserve.wire.step_feed). See docs/ARCHITECTURE.md, "One step"."""
from __future__ import annotations

import itertools
import operator
from typing import TYPE_CHECKING

from pagedserve.gateway import seq_end
from pagedserve.gateway.seq_queue import insert
from pagedserve.gateway.sequence import SeqStatus, Sequence
from pagedserve.gateway.step_records import Planned
from pagedserve.wire.pending_token import PENDING
from pagedserve.wire.reserve_messages import Rejection
from pagedserve.wire.step_delta import StepDelta

if TYPE_CHECKING:
    from pagedserve.gateway.scheduler import Scheduler


def _current(seqs: dict[str, Sequence], planned_by_id: dict[str, Sequence] | None, seq_id: str
             ) -> Sequence | None:
    """The sequence of `seq_id`, where it is the one planned (`planned_by_id`; None: any)."""
    seq = seqs.get(seq_id)
    return seq if planned_by_id is None or planned_by_id.get(seq_id) is seq else None


def reject(sched: Scheduler, rejections: list[Rejection], planned: Planned | None) -> list[Sequence]:
    """End the sequences memsvc rejected (but those aborted since a plan made ahead): they
    and the samples they hold finish with an error. The sequences ended."""
    planned_by_id = dict(zip(planned.ids, planned.seqs)) if planned is not None else None
    rejected = []
    for r in rejections:
        seq = _current(sched.seqs, planned_by_id, r.seq_id)
        if seq is None:  # aborted since a plan made ahead
            continue
        seq_end.remove(sched, r.seq_id)
        sched.waiting.remove(seq)
        seq.finish("error", r.reason)
        seq_end.end_held(sched, r.seq_id, "error", r.reason)
        rejected.append(seq)
    return rejected


def sequences(sched: Scheduler, seq_ids: list[str], planned: Planned | None, ahead_of: StepDelta | None
              ) -> tuple[list[Sequence | None], bool, list[int] | None]:
    """The sequences of the granted `seq_ids` (None: ended since their plan), whether any
    ended, and where the running step's tokens end where the plan knew it (`Planned.fed_ends`)."""
    all_seqs = sched.seqs
    seqs = list(map(all_seqs.get, seq_ids))
    fed_ends = None
    if planned is None:
        ended = not all(map(operator.is_not, seqs, itertools.repeat(None)))
    elif seq_ids != planned.ids or seqs != planned.seqs:  # not all granted, or some ended since
        planned_by_id = dict(zip(planned.ids, planned.seqs))
        seqs = [_current(all_seqs, planned_by_id, seq_id) for seq_id in seq_ids]
        ended = not all(map(operator.is_not, seqs, itertools.repeat(None)))
    else:
        ended = False
        if planned.ahead_of is ahead_of:
            fed_ends = planned.fed_ends
    return seqs, ended, fed_ends


def without_ended(sched: Scheduler, step: StepDelta, num_cached: list[int]) -> tuple[StepDelta, list[int]]:
    """`step` less the sequences that ended since their plan (memsvc frees them next), and
    the cache hits of those kept."""
    hits = dict(zip(step.seq_ids, num_cached))
    keep = StepDelta(pool_epoch=step.pool_epoch, copies=step.copies)
    at = 0
    for i, seq in enumerate(step.seqs):
        k = step.num_new_blocks[i]
        seq_id = step.seq_ids[i]
        if seq is None:
            if seq_id not in sched.to_free:
                sched.to_free.append(seq_id)
        else:
            keep.seq_ids.append(seq_id)
            keep.start_pos.append(step.start_pos[i])
            keep.num_tokens.append(step.num_tokens[i])
            keep.table_start.append(step.table_start[i])
            keep.num_new_blocks.append(k)
            keep.new_blocks += step.new_blocks[at:at + k]
            keep.seqs.append(seq)
        at += k
    return keep, [hits[s] for s in keep.seq_ids]


def tokens(sched: Scheduler, step: StepDelta, num_cached: list[int], inflight: dict | None) -> None:
    """Fill the step's tokens and sample columns, and admit the new sequences it grants."""
    tokens, sample = step.token_ids, step.sample
    waiting, running = SeqStatus.WAITING, SeqStatus.RUNNING
    for i, seq in enumerate(step.seqs):
        seq_id = seq.seq_id
        admitted = seq.status is waiting  # so not in the running batch (an id may come back)
        if admitted:
            hit = num_cached[i]
            sched.waiting.remove(seq)
            insert(sched.running, seq)
            seq.status = running
            seq.num_computed = hit
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = hit
        start = step.start_pos[i]
        inflight_step = inflight.get(seq_id) if inflight is not None and not admitted else None
        fed = inflight_step is not None and inflight_step[1]  # its next token: the running step's sample
        computed = inflight_step[0] if inflight_step is not None else seq.num_computed
        assert start == computed, (seq_id, start, computed)
        end = start + step.num_tokens[i]
        prompt, out = seq.prompt_token_ids, seq.output_token_ids
        plen = len(prompt)
        if fed:
            tokens.append(PENDING)  # position plen + len(out): the one token granted
        elif start >= plen:  # decode: no copy of the whole context
            tokens += out[start - plen:end - plen]
        else:
            tokens += (prompt + out)[start:end]
        sample.append(end == plen + len(out) + fed)
