"""The general path of `Scheduler.on_sampled`: a step's outputs applied to its sequences one
by one. `one` applies one sequence's output (fork point, beam search, prompt logprobs, the
token and whether a stop token or the length ends it); `by_id` where the outputs are not in
the batch's order; `each` where they are, taking a plain token inline and leaving
`Scheduler.took` (pagedserve.gateway.step_records.Took) where every sequence took one and
none ended. A sequence whose output cannot be applied ends alone (seq_end.fail_alone). See
docs/ARCHITECTURE.md, "One step"."""
from __future__ import annotations

from typing import TYPE_CHECKING

from pagedserve.gateway import prompt_logprobs, seq_end
from pagedserve.gateway.seq_queue import insert
from pagedserve.gateway.step_records import Took
from pagedserve.gateway.step_updates import StepUpdates
from pagedserve.wire.protocol import SampleOutput, SamplingParams
from pagedserve.wire.step_delta import StepDelta
from pagedserve.wire.step_outputs import StepOutputs

if TYPE_CHECKING:
    from pagedserve.gateway.scheduler import Scheduler

def by_id(sched: Scheduler, batch: StepDelta, outputs: StepOutputs, updates: StepUpdates) -> None:
    """Each sequence of `batch` takes its output, found by id (none: it sampled nothing)."""
    outputs_by_id = {o.seq_id: o for o in outputs}
    for seq_id, seq, start, n in zip(batch.seq_ids, batch.seqs, batch.start_pos, batch.num_tokens):
        try:
            one(sched, seq_id, seq, start, start + n, outputs_by_id.get(seq_id), updates)
        except Exception as e:  # noqa: BLE001 - one request's fault must not end the others
            seq_end.fail_alone(sched, sched.seqs.get(seq_id, seq), seq, e)


def each(sched: Scheduler, batch: StepDelta, outputs: StepOutputs, updates: StepUpdates) -> None:
    """`on_sampled` of outputs in the batch's order: a sequence that takes a plain token
    takes it here as `one` would, any other goes through `one`; where every one took a
    plain token and none ended, what they took is left in `sched.took`."""
    get = sched.seqs.get
    stop_sets: dict[int, frozenset[int]] = {}  # id(sampling) -> its stop tokens
    num_tokens: list[int] = []
    stops: list[frozenset[int]] = []
    plain, least = True, 1 << 62
    for seq_id, source, start, n, out in zip(batch.seq_ids, batch.seqs, batch.start_pos,
                                             batch.num_tokens, outputs):
        try:
            seq = get(seq_id)
            if (seq is not source or seq is None or out.error or not out.sampled
                    or seq.prompt_logprobs is not None or seq.fork_at is not None):
                plain = False
                one(sched, seq_id, source, start, start + n, out, updates)
                continue
            seq.num_computed = start + n
            token, sp, output = out.token_id, seq.sampling, seq.output_token_ids
            output.append(token)
            stop = stop_sets.get(id(sp))
            if stop is None:
                stop = stop_sets[id(sp)] = stop_tokens(sched, sp)
            left = seq.tokens_left()
            if token in stop or left <= 0:
                plain = False
                seq_end.drop(sched, seq)
                seq.finish("stop" if token in stop else "length")
                updates.add(seq, token, out.logprob, out.top_logprobs, True)
                continue
            updates.add(seq, token, out.logprob, out.top_logprobs)
            num_tokens.append(len(seq.prompt_token_ids) + len(output))
            stops.append(stop)
            if left < least:
                least = left
        except Exception as e:  # noqa: BLE001 - one request's fault must not end the others
            plain = False
            seq_end.fail_alone(sched, sched.seqs.get(seq_id, source), source, e)
    if plain:
        sched.took = Took(batch.seqs, list(outputs.tokens), num_tokens, least, stops, sched.removals,
                          frozenset().union(*stop_sets.values()), [n - 1 for n in num_tokens],
                          list(batch.seq_ids))


def one(sched: Scheduler, seq_id: str, source, start: int, computed: int, out: SampleOutput | None,
        updates: StepUpdates) -> None:
    """One sequence's part of `on_sampled`: the step computed its tokens from `start` to
    `computed`; `out`, its output (None: it sampled nothing)."""
    seq = sched.seqs.get(seq_id)
    if seq is None or source is not None and source is not seq:  # ended while the step ran
        return
    if out is not None and out.error:
        return seq_end.fail_alone(sched, seq, source, out.error)
    seq.num_computed = computed
    if seq.prompt_logprobs is not None:
        prompt_logprobs.keep(seq, start, out)
    if seq.fork_at is not None and computed >= seq.fork_at:
        for sample in sched.holds.release(seq):
            insert(sched.running, sample)
            sched.forks.append((seq_id, sample.seq_id))
    if out is None or not out.sampled:
        return
    beams = sched.beams
    if beams and seq.request_id in beams:
        updates.extend(sched.beam_searches.report(seq, out.top_logprobs))
        return
    token, sp, output = out.token_id, seq.sampling, seq.output_token_ids
    output.append(token)
    if token in sp.stop_token_ids or (not sp.ignore_eos and token in sched.eos_token_ids):
        reason = "stop"
    elif seq.tokens_left() <= 0:
        reason = "length"
    else:
        reason = None
    if reason:
        seq_end.drop(sched, seq)
        seq.finish(reason)
    first = seq.prompt_logprobs if len(output) == 1 else None
    updates.add(seq, token, out.logprob, out.top_logprobs, bool(reason), first)


def stop_tokens(sched: Scheduler, sp: SamplingParams) -> frozenset[int]:
    """The tokens that stop a sequence sampled so, as `one` tells them."""
    return frozenset(sp.stop_token_ids).union(() if sp.ignore_eos else sched.eos_token_ids)
