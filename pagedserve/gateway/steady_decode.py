"""The scheduler's steady-decode fast paths, over columns: a step where every running sequence
computes the token it sampled last and samples the next. `steady_run` (plan made ahead),
`granted_as_planned` and `all_fed` (on_reserved), `sampled_in_order` and `sampled_steady`
(on_sampled) each check the step is one, else decline with nothing done, and give what the
general path gives (tests/unit/gateway/test_scheduler_fast_paths.py runs both on random
workloads). The scheduler calls them through its methods of the same names (a leading
underscore), where a test may decline them. See docs/ARCHITECTURE.md, "The step path"."""
from __future__ import annotations

import operator
from typing import TYPE_CHECKING

from pagedserve.gateway import general_sampled, seq_end
from pagedserve.gateway.sequence import SeqStatus, Sequence
from pagedserve.gateway.step_records import Planned, Took
from pagedserve.gateway.step_updates import StepUpdates
from pagedserve.wire.pending_token import PENDING
from pagedserve.wire.reserve_messages import Fills
from pagedserve.wire.step_delta import StepDelta
from pagedserve.wire.step_outputs import StepOutputs

if TYPE_CHECKING:
    from pagedserve.gateway.scheduler import Scheduler

_status = operator.attrgetter("status")


def steady_run(sched: Scheduler, ahead_of: StepDelta, took: Took, budget: int, max_seqs: int
               ) -> tuple[Fills, list[str], list[int], list[int], list[int]] | None:
    """The fills and running columns of a steady decode step planned ahead, and where
    `ahead_of`'s tokens end; None (nothing done) where it is not one: the running sequences
    took their last tokens from the last step (`took`), none of them its last but one, none
    taken out of `seqs` since, and are `ahead_of`'s, in its order, each computing there
    the token it took and sampling the next, which it computes next, PENDING; what
    memsvc holds pending is the tokens they took."""
    running = sched.running
    n = len(running)
    if (took.left <= 1 or took.removals != sched.removals or sched.swapped or n > max_seqs
            or n > budget or took.seqs != running
            or ahead_of.seqs != running or ahead_of.num_tokens.count(1) != n
            or not all(ahead_of.sample)):
        return None
    held = ahead_of.start_pos
    if held != took.held:  # (equal: each ends where took.num_tokens says)
        return None
    ends = took.num_tokens
    # on_reserved's: seqs[i] is the sequence of seq_ids[i]; took.ids, the same ids, are the
    # same objects as the last plan's (pending's compare finds each identical, no text compared)
    run_ids = list(took.ids)
    fills = sched.pending.take_known(run_ids, held, took.tokens)
    if fills is None:
        return None
    sched.pending.hold_all(run_ids, ends)
    return fills, run_ids, [1] * n, [PENDING] * n, ends


def granted_as_planned(sched: Scheduler, planned: Planned | None, seq_ids: list[str]) -> list[Sequence] | None:
    """The sequences of `seq_ids` where they are the plan's (`planned`) and none left
    `seqs` since: those it found then (else None)."""
    if planned is not None and planned.removals == sched.removals and seq_ids == planned.ids:
        return planned.seqs
    return None


def all_fed(step: StepDelta, ahead_of: StepDelta, ends: list[int] | None = None) -> bool:
    """Every sequence of `step` computes the one token the running step `ahead_of`
    samples for it (a steady decode step). `ends`: where `ahead_of`'s tokens end, each
    sampling, in `step`'s order, where the plan knew it."""
    if ends is None and step.seq_ids == ahead_of.seq_ids and all(ahead_of.sample):  # no lookup
        ends = list(map(operator.add, ahead_of.start_pos, ahead_of.num_tokens))
    elif ends is None:
        inflight = ahead_of.progress()
        ends = [p[0] if p is not None and p[1] else None for p in map(inflight.get, step.seq_ids)]
    return (step.start_pos == ends and step.num_tokens.count(1) == len(ends)
            and SeqStatus.WAITING not in map(_status, step.seqs))


def sampled_in_order(sched: Scheduler, batch: StepDelta, outputs: StepOutputs, updates: StepUpdates) -> bool:
    """`on_sampled`'s loop where every sequence of `batch` has its output, in the batch's
    order (False, nothing done, where not)."""
    if sched.beams or outputs.seq_ids != batch.seq_ids:
        return False
    took, sched.took = sched.took, None
    if took is None or not sched._sampled_steady(batch, outputs, took, updates):
        general_sampled.each(sched, batch, outputs, updates)
    return True


def sampled_steady(sched: Scheduler, batch: StepDelta, outputs: StepOutputs, took: Took,
                   updates: StepUpdates) -> bool:
    """`general_sampled.each` where the batch's sequences are `took`'s, each still current,
    each output a sampled token (with logprobs at most) that neither stops its sequence
    nor is past its length: each takes its token, `updates` (empty) become the batch's
    sequences and tokens, and the columns of `took` say the rest. False, nothing done,
    where not."""
    seqs = batch.seqs
    tokens, more = outputs.tokens, outputs.more
    if (took.left <= 1 or seqs != took.seqs or took.removals != sched.removals
            or any(o.error or not o.sampled for o in more.values())
            or _stops_any(took, tokens)):
        return False
    failed: list[Sequence] = []
    for seq, end, token in zip(seqs, map(operator.add, batch.start_pos, batch.num_tokens), tokens):
        try:
            seq.num_computed = end
            seq.output_token_ids.append(token)
        except Exception as e:  # noqa: BLE001 - one request's fault must not end the others
            failed.append(seq)
            seq_end.fail_alone(sched, seq, seq, e)
    if failed:  # left out of the updates (seq_end.fail_alone gave theirs)
        rows = {}  # batch row -> its row in the updates
        for k, seq in enumerate(seqs):
            if seq not in failed:
                rows[k] = len(updates)
                updates.add(seq, tokens[k])
    else:
        updates.seqs, updates.tokens, rows = list(seqs), list(tokens), None
    for k, out in more.items():
        row = k if rows is None else rows.get(k)
        if row is not None:
            updates.carry(row, out.logprob, out.top_logprobs)
    if not failed:
        held = took.num_tokens
        sched.took = Took(seqs, tokens, [n + 1 for n in held], took.left - 1, took.stops, sched.removals,
                          took.stop_any, held, took.ids)
    return True


def _stops_any(took: Took, tokens: list[int]) -> bool:
    """A token of `tokens` is one of those that stop its sequence (`took.stops`, in order);
    none is where none is in `took.stop_any`."""
    if not took.stop_any or took.stop_any.isdisjoint(tokens):
        return False
    return any(map(operator.contains, took.stops, tokens))
