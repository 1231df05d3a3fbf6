"""Continuous batching at the iteration level: which sequences compute which tokens this step.

The scheduler proposes (a plan in priority order: running, swapped-out to resume, waiting),
memsvc decides what fits (grants, preemptions by swap or recompute, resumptions), the
executor computes, and the scheduler applies the sampled tokens.

Sharing: a request with n > 1 samples prefills one sequence up to its last prompt token,
then forks the others from it (pagedserve.gateway.samples; memsvc Fork: the prompt's blocks are shared,
the partial last one copied on write). Beam search (pagedserve.gateway.beam_search) forks a beam for
each extra continuation of a parent and frees the beams that are pruned. Forks are queued
in `forks` and travel in the next plan (`Plan.forks`): memsvc makes them before it frees
anything. The scheduler holds no block table: memsvc's grants (pagedserve.wire.protocol.Grants) go on
as the step's columns (pagedserve.wire.step_delta), block-table changes included, and whoever runs
the model applies them and derives the slots.

A steady decode step (every running sequence computes the token it sampled last and samples
the next) has fast paths over columns: `_sampled_steady` and `_sampled_each` (on_sampled),
`_steady_run` (plan made ahead), `_granted_as_planned` and `_all_fed`'s ends (on_reserved).
Each checks the step is one, else declines, and gives what the general path gives
(tests/unit/gateway/test_scheduler_fast_paths.py runs both on random workloads).
"""
from __future__ import annotations

import bisect
import dataclasses
import itertools
import operator
from dataclasses import dataclass

from pagedserve.gateway.beam_search import BeamDone, Beams, BeamSearch
from pagedserve.gateway.pending_tokens import PendingTokens
from pagedserve.gateway.samples import SampleHolds
from pagedserve.gateway.scheduler_config import SchedulerConfig
from pagedserve.gateway.seq_update import SeqUpdate
from pagedserve.gateway.sequence import SeqStatus, Sequence
from pagedserve.wire.pending_token import PENDING
from pagedserve.wire.protocol import (
    Plan,
    PlanEntry,
    ReserveResult,
    SampleOutput,
    SamplingParams,
)
from pagedserve.wire.step_delta import StepDelta


@dataclass
class _Took:
    """What `on_sampled` leaves where each sequence of its batch took a plain token (no
    error, fork point, prompt logprobs or beam search) and none ended: the batch's
    sequences, in its order, the tokens they took, how many tokens each holds now, the
    fewest tokens any of them may still take before its length ends it, and the tokens
    that stop each. The next plan made ahead and the next `on_sampled` read it while their
    batch's sequences are these (only `on_sampled` adds their tokens)."""

    seqs: list[Sequence]
    tokens: list[int]
    num_tokens: list[int]
    left: int
    stops: list[frozenset[int]]
    removals: int  # Scheduler._removals then: while it stays, the sequences are current


@dataclass
class _Planned:
    """A plan made ahead of `ahead_of`, for the answer to it: its ids and their sequences
    then, in plan order (a sequence may end, or its id be reused by a new request, before
    the answer is applied); where its running part was a steady decode step
    (`Scheduler._steady_run`), the positions `ahead_of`'s tokens end at, in the same order."""

    ids: list[str]
    seqs: list[Sequence]
    ahead_of: StepDelta
    fed_ends: list[int] | None
    removals: int  # Scheduler._removals then: while it stays, `seqs` are current


_status = operator.attrgetter("status")
_token_id = operator.attrgetter("token_id")
_error = operator.attrgetter("error")
_sampled_flag = operator.attrgetter("sampled")
_seq_id = operator.attrgetter("seq_id")


def _insert(queue: list[Sequence], seq: Sequence) -> None:
    bisect.insort(queue, seq, key=lambda s: s.sort_key)


class Scheduler:
    def __init__(self, config: SchedulerConfig, eos_token_ids: list[int], block_size: int = 16):
        self.config = config.resolved()
        self.block_size = block_size
        self.eos_token_ids = set(eos_token_ids)
        self.waiting: list[Sequence] = []  # sorted by sort_key
        self.running: list[Sequence] = []  # sorted by sort_key
        self.swapped: list[Sequence] = []  # sorted by sort_key
        self.seqs: dict[str, Sequence] = {}
        self.to_free: list[str] = []
        self.forks: list[tuple[str, str]] = []  # (parent, child), for memsvc before the next reserve
        self.left_out: list[str] = []  # sequences the executor left out of a step (Plan.failed)
        self._failed_alone: list[SeqUpdate] = []
        self._holds = SampleHolds()
        self._beams = Beams(self)
        self.num_preemptions = 0
        self.num_swapped_out = 0
        self.num_beam_releases = 0
        self.pending = PendingTokens()  # plan ahead: tokens memsvc holds whose ids it lacks
        self.planned: _Planned | None = None  # the last plan, made ahead, for the answer to it
        self._took: _Took | None = None  # the last on_sampled's
        self._removals = 0  # sequences taken out of `seqs` so far (`_remove`)

    @property
    def held(self) -> dict[str, list[Sequence]]:  # parent id -> samples forked at its fork point
        return self._holds.held

    @property
    def beams(self) -> dict[str, BeamSearch]:  # request id -> its beam search
        return self._beams.searches

    def add(self, seq: Sequence, samples: list[Sequence] | None = None) -> None:
        """Queue `seq`; `samples` (the request's other n - 1) fork from it after its prefill."""
        for s in [seq, *(samples or [])]:
            if s.seq_id in self.seqs:
                raise ValueError(f"sequence {s.seq_id} already exists")
        self.seqs[seq.seq_id] = seq
        _insert(self.waiting, seq)
        if not samples:
            return
        for s in samples:
            self.seqs[s.seq_id] = s
        if not self._holds.hold(seq, samples):
            for s in samples:
                _insert(self.waiting, s)

    def add_beam_search(self, seq: Sequence, search: BeamSearch) -> None:
        self.add(seq)
        self.beams[seq.request_id] = search

    def abort(self, seq_id: str, reason: str = "abort") -> Sequence | None:
        """Stop a sequence; its blocks are freed by the next reserve."""
        seq = self.seqs.get(seq_id)
        if seq is None:
            return None
        self.drop(seq)
        self._holds.drop(seq_id)
        self._end_held(seq_id, reason)
        if seq.status is not SeqStatus.FINISHED:
            seq.finish(reason)
        return seq

    def abort_request(self, request_id: str, reason: str = "abort") -> None:
        for seq_id in [s.seq_id for s in self.seqs.values() if s.request_id == request_id]:
            self.abort(seq_id, reason)
        self.beams.pop(request_id, None)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self.to_free)

    def take_forks(self) -> list[tuple[str, str]]:
        forks, self.forks = self.forks, []
        return forks

    def plan(self, ahead_of: StepDelta | None = None) -> Plan | None:
        """The next step's plan. `ahead_of`: the batch the executor is running now; plan the
        step after it as if that batch's tokens were computed and its samples drawn (their
        ids pending), or None where that cannot be planned ahead (forks, beam search,
        swapped-out sequences: see `can_plan_ahead`)."""
        took = self._took
        if ahead_of is not None and not self.can_plan_ahead():
            return None
        budget = self.config.max_num_batched_tokens
        max_seqs = self.config.max_num_seqs
        steady = fed_ends = None
        if ahead_of is not None and took is not None:
            steady = self._steady_run(ahead_of, took, budget, max_seqs)
        if steady is not None:
            fills, run_ids, run_counts, run_tokens, fed_ends = steady
            budget -= len(run_ids)
        else:
            fills = self.pending.take_fills(self.seqs)
            run_ids, run_counts, run_tokens, budget = self._run(ahead_of, budget, max_seqs)
        entries: list[PlanEntry] = []
        for seq in self.waiting:
            if budget < 1 or len(run_ids) + len(entries) >= max_seqs:
                break
            if not self.config.enable_chunked_prefill and seq.compute_limit > budget:
                break
            entries.append(PlanEntry(seq.seq_id, seq.all_token_ids[: seq.compute_limit], True,
                                     seq.max_len, max_new_tokens=budget, final_len=seq.final_len,
                                     salt=seq.salt,
                                     skip_prefix_cache=seq.sampling.prompt_logprobs is not None))
            budget -= min(seq.compute_limit, budget)
        plan = Plan(entries=entries, free=self.to_free, forks=self.forks, ahead=ahead_of is not None,
                    fills=fills, run_ids=run_ids, run_counts=run_counts, run_tokens=run_tokens)
        if plan.ahead:
            ids = plan.seq_ids()
            if steady is not None and not entries:  # the running sequences, current (`_steady_run`)
                planned = list(self.running)
            else:
                planned = list(map(self.seqs.__getitem__, ids))
            self.planned = _Planned(ids, planned, ahead_of, fed_ends, self._removals)
        else:
            self.planned = None
        self.to_free, self.forks = [], []
        return plan

    def _run(self, ahead_of: StepDelta | None, budget: int, max_seqs: int
             ) -> tuple[list[str], list[int], list[int], int]:
        """The plan's running sequences (swapped-out ones to resume among them): their ids,
        token counts and tokens (PENDING: the token `ahead_of` samples, held in `pending`),
        and the budget left."""
        inflight = ahead_of.progress() if ahead_of is not None else None
        run_ids: list[str] = []
        run_counts: list[int] = []
        run_tokens: list[int] = []
        hold = self.pending.hold
        for seq in self.running + self.swapped:
            if len(run_ids) >= max_seqs:
                break
            out, prompt = seq.output_token_ids, seq.prompt_token_ids
            plen = len(prompt)
            num_tokens = plen + len(out)
            computed = seq.num_computed
            limit = num_tokens if seq.fork_at is None else seq.fork_at
            step = inflight.get(seq.seq_id) if inflight else None
            if step is not None:
                computed, samples = step
                if samples:
                    if seq.tokens_left() <= 1:
                        continue  # its next token is its last
                    limit += 1
            n = min(limit - computed, budget)
            if n < 1:
                continue
            known = min(n, num_tokens - computed)  # the rest is the token the step samples
            run_ids.append(seq.seq_id)
            run_counts.append(n)
            if computed >= plen:
                run_tokens += out[computed - plen : computed - plen + known]
            else:
                run_tokens += (prompt + out)[computed : computed + known]
            if known < n:
                run_tokens.append(PENDING)
                hold(seq.seq_id, computed + known)
            budget -= n
        return run_ids, run_counts, run_tokens, budget

    def _steady_run(self, ahead_of: StepDelta, took: _Took, budget: int, max_seqs: int
                    ) -> tuple[list[tuple[str, int, int]], list[str], list[int], list[int], list[int]] | None:
        """The fills and `_run` of a steady decode step planned ahead, and where `ahead_of`'s
        tokens end; None (nothing done) where it is not one: the running sequences took
        their last tokens from the last step (`took`), none of them its last but one, none
        taken out of `seqs` since, and are `ahead_of`'s, in its order, each computing there
        the token it took and sampling the next, which it computes next, PENDING; what
        memsvc holds pending is the tokens they took."""
        running = self.running
        n = len(running)
        if (took.left <= 1 or took.removals != self._removals or self.swapped or n > max_seqs
                or n > budget or took.seqs != running
                or ahead_of.seqs != running or ahead_of.num_tokens.count(1) != n
                or not all(ahead_of.sample)):
            return None
        held = ahead_of.start_pos
        ends = [p + 1 for p in held]
        if ends != took.num_tokens:
            return None
        run_ids = list(ahead_of.seq_ids)  # on_reserved's: seqs[i] is the sequence of seq_ids[i]
        fills = self.pending.take_known(run_ids, held, took.tokens)
        if fills is None:
            return None
        self.pending.hold_all(run_ids, ends)
        return fills, run_ids, [1] * n, [PENDING] * n, ends

    def can_plan_ahead(self) -> bool:
        """No fork is due or queued, no beam search runs, nothing is swapped out: the next
        plan depends on the running step only through its token counts."""
        return not (self.forks or self.held or self.beams or self.swapped)

    def deferred(self, plan: Plan) -> None:
        """memsvc did not grant `plan` (made ahead): it holds none of its pending tokens."""
        self.planned = None
        self.pending.deferred()

    def on_reserved(self, result: ReserveResult, ahead_of: StepDelta | None = None
                    ) -> tuple[StepDelta, list[Sequence]]:
        """Apply memsvc's answer; return the batch to execute (in the answer's pool) and the
        sequences rejected. `ahead_of`: the batch still running, whose tokens are not applied
        yet (the answer is to a plan made ahead of it): a token that batch samples is
        computed as PENDING (pagedserve.wire.step_feed), the executor's own last sample."""
        for p in result.preempted:
            seq = self.seqs[p.seq_id]
            for queue in (self.running, self.swapped):
                if seq in queue:
                    queue.remove(seq)
            seq.num_preemptions += 1
            if p.mode != "swap":
                self.pending.drop(seq.seq_id)
            self.num_preemptions += 1
            if p.mode == "swap":
                seq.status = SeqStatus.SWAPPED
                self.num_swapped_out += 1
                _insert(self.swapped, seq)
            else:
                seq.status = SeqStatus.WAITING
                seq.num_computed = 0
                _insert(self.waiting, seq)
        for seq_id in result.resumed:
            seq = self.seqs[seq_id]
            self.swapped.remove(seq)
            seq.status = SeqStatus.RUNNING
            _insert(self.running, seq)
        planned, self.planned = self.planned, None
        all_seqs = self.seqs
        planned_by_id = dict(zip(planned.ids, planned.seqs)) if planned is not None and result.rejected else None

        def current(seq_id: str) -> Sequence | None:
            seq = all_seqs.get(seq_id)
            return seq if planned_by_id is None or planned_by_id.get(seq_id) is seq else None

        rejected = []
        for r in result.rejected:
            seq = current(r.seq_id)
            if seq is None:  # aborted since a plan made ahead
                continue
            self._remove(r.seq_id)
            self.waiting.remove(seq)
            seq.finish("error", r.reason)
            self._end_held(r.seq_id, "error", r.reason)
            rejected.append(seq)
        g = result.grants
        fed_ends = None
        seqs = self._granted_as_planned(planned, g.seq_ids)
        if seqs is None:
            seqs = list(map(all_seqs.get, g.seq_ids))
        if planned is None:
            ended = not all(map(operator.is_not, seqs, itertools.repeat(None)))
        elif g.seq_ids != planned.ids or seqs != planned.seqs:  # not all granted, or some ended since
            planned_by_id = planned_by_id or dict(zip(planned.ids, planned.seqs))
            seqs = list(map(current, g.seq_ids))
            ended = not all(map(operator.is_not, seqs, itertools.repeat(None)))
        else:
            ended = False
            if planned.ahead_of is ahead_of:
                fed_ends = planned.fed_ends
        step = StepDelta(g.seq_ids, g.start_pos, g.num_tokens, [], [], g.table_start, g.num_new_blocks,
                         g.new_blocks, seqs, pool_epoch=result.pool_epoch, copies=result.block_copies)
        cached = g.num_cached
        if ended:  # since a plan made ahead: memsvc frees it next
            hits = dict(zip(g.seq_ids, cached))
            step = self._without_ended(step)
            cached = [hits[s] for s in step.seq_ids]
        if ahead_of is not None and self._all_fed(step, ahead_of, fed_ends):
            n = len(step.seq_ids)
            step.token_ids, step.sample = [PENDING] * n, [True] * n
        else:
            self._tokens(step, cached, ahead_of.progress() if ahead_of is not None else None)
        return step, rejected

    def _granted_as_planned(self, planned: _Planned | None, seq_ids: list[str]) -> list[Sequence] | None:
        """The sequences of `seq_ids` where they are the plan's (`planned`) and none left
        `seqs` since: those it found then (else None)."""
        if planned is not None and planned.removals == self._removals and seq_ids == planned.ids:
            return planned.seqs
        return None

    @staticmethod
    def _all_fed(step: StepDelta, ahead_of: StepDelta, ends: list[int] | None = None) -> bool:
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

    def _without_ended(self, step: StepDelta) -> StepDelta:
        """`step` less the sequences that ended since their plan (memsvc frees them next)."""
        keep = StepDelta(pool_epoch=step.pool_epoch, copies=step.copies)
        at = 0
        for i, seq in enumerate(step.seqs):
            k = step.num_new_blocks[i]
            seq_id = step.seq_ids[i]
            if seq is None:
                if seq_id not in self.to_free:
                    self.to_free.append(seq_id)
            else:
                keep.seq_ids.append(seq_id)
                keep.start_pos.append(step.start_pos[i])
                keep.num_tokens.append(step.num_tokens[i])
                keep.table_start.append(step.table_start[i])
                keep.num_new_blocks.append(k)
                keep.new_blocks += step.new_blocks[at:at + k]
                keep.seqs.append(seq)
            at += k
        return keep

    def _tokens(self, step: StepDelta, num_cached: list[int], inflight: dict | None) -> None:
        """Fill the step's tokens and sample columns, and admit the new sequences it grants."""
        tokens, sample = step.token_ids, step.sample
        waiting, running = SeqStatus.WAITING, SeqStatus.RUNNING
        for i, seq in enumerate(step.seqs):
            seq_id = seq.seq_id
            admitted = seq.status is waiting  # so not in the running batch (an id may come back)
            if admitted:
                hit = num_cached[i]
                self.waiting.remove(seq)
                _insert(self.running, seq)
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

    def on_sampled(self, batch: StepDelta, outputs: list[SampleOutput]) -> list[SeqUpdate | BeamDone]:
        """Apply a step's outputs to the sequences it was made for (a sequence that ended
        since, its id maybe reused by a new request, gets nothing)."""
        updates: list[SeqUpdate | BeamDone] = []
        if not self._sampled_in_order(batch, outputs, updates):
            self._took = None
            by_id = {o.seq_id: o for o in outputs}
            sampled = self._sampled
            for seq_id, seq, start, n in zip(batch.seq_ids, batch.seqs, batch.start_pos, batch.num_tokens):
                try:
                    sampled(seq_id, seq, start, start + n, by_id.get(seq_id), updates)
                except Exception as e:  # noqa: BLE001 - one request's fault must not end the others
                    self._fail_alone(self.seqs.get(seq_id, seq), seq, e)
        if self._failed_alone:
            updates.extend(self._failed_alone)
            self._failed_alone = []
        return updates

    def _sampled_in_order(self, batch: StepDelta, outputs: list[SampleOutput], updates: list) -> bool:
        """`on_sampled`'s loop where every sequence of `batch` has its output, in the batch's
        order (False, nothing done, where not)."""
        seq_ids = batch.seq_ids
        if self.beams or len(outputs) != len(seq_ids) or list(map(_seq_id, outputs)) != seq_ids:
            return False
        took, self._took = self._took, None
        if took is None or not self._sampled_steady(batch, outputs, took, updates):
            self._sampled_each(batch, outputs, updates)
        return True

    def _sampled_each(self, batch: StepDelta, outputs: list[SampleOutput], updates: list) -> None:
        """`on_sampled` of outputs in the batch's order: a sequence that takes a plain token
        takes it here as `_sampled` would, any other goes through `_sampled`; where every
        one took a plain token and none ended, what they took is left in `_took`."""
        get, sampled = self.seqs.get, self._sampled
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
                    sampled(seq_id, source, start, start + n, out, updates)
                    continue
                seq.num_computed = start + n
                token, sp, output = out.token_id, seq.sampling, seq.output_token_ids
                output.append(token)
                stop = stop_sets.get(id(sp))
                if stop is None:
                    stop = stop_sets[id(sp)] = self._stop_tokens(sp)
                left = seq.tokens_left()
                if token in stop or left <= 0:
                    plain = False
                    self.drop(seq)
                    seq.finish("stop" if token in stop else "length")
                    updates.append(SeqUpdate(seq, token, out.logprob, out.top_logprobs, True))
                    continue
                updates.append(SeqUpdate(seq, token, out.logprob, out.top_logprobs))
                num_tokens.append(len(seq.prompt_token_ids) + len(output))
                stops.append(stop)
                if left < least:
                    least = left
            except Exception as e:  # noqa: BLE001 - one request's fault must not end the others
                plain = False
                self._fail_alone(self.seqs.get(seq_id, source), source, e)
        if plain:
            self._took = _Took(batch.seqs, list(map(_token_id, outputs)), num_tokens, least, stops,
                               self._removals)

    def _sampled_steady(self, batch: StepDelta, outputs: list[SampleOutput], took: _Took,
                        updates: list) -> bool:
        """`_sampled_each` where the batch's sequences are `took`'s, each still current, none
        of their outputs an error, each a sampled token that neither stops it nor is past
        its length: each takes its token, the columns of `took` say the rest. False,
        nothing done, where not."""
        seqs = batch.seqs
        tokens = list(map(_token_id, outputs))
        if (took.left <= 1 or seqs != took.seqs or took.removals != self._removals
                or any(map(_error, outputs)) or not all(map(_sampled_flag, outputs))
                or any(map(operator.contains, took.stops, tokens))):
            return False
        plain = True
        for seq, end, token, out in zip(seqs, map(operator.add, batch.start_pos, batch.num_tokens), tokens,
                                        outputs):
            try:
                seq.num_computed = end
                seq.output_token_ids.append(token)
                updates.append(SeqUpdate(seq, token, out.logprob, out.top_logprobs))
            except Exception as e:  # noqa: BLE001 - one request's fault must not end the others
                plain = False
                self._fail_alone(seq, seq, e)
        if plain:
            self._took = _Took(seqs, tokens, list(map((1).__add__, took.num_tokens)), took.left - 1,
                               took.stops, self._removals)
        return True

    def _fail_alone(self, seq: Sequence | None, source, why: Exception | str) -> None:
        """End `seq` alone: the executor left it out (`why` its reason), or applying its output
        raised `why`; its request gets an error update naming it."""
        if seq is None or source is not None and source is not seq:  # ended already
            return
        if isinstance(why, str):
            error = f"the executor refused this sequence: {why}"
            self.left_out.append(seq.seq_id)
        else:
            error = f"the gateway could not apply this sequence's output: {type(why).__name__}: {why}"
        self.abort(seq.seq_id, "error")
        seq.error = error
        self._failed_alone.append(SeqUpdate(seq, None, finished=True, error=error))

    def _sampled(self, seq_id: str, source, start: int, computed: int, out: SampleOutput | None,
                 updates: list) -> None:
        """One sequence's part of `on_sampled`: the step computed its tokens from `start` to
        `computed`; `out`, its output (None: it sampled nothing)."""
        seq = self.seqs.get(seq_id)
        if seq is None or source is not None and source is not seq:  # ended while the step ran
            return
        if out is not None and out.error:
            return self._fail_alone(seq, source, out.error)
        seq.num_computed = computed
        if seq.prompt_logprobs is not None:
            self._prompt_logprobs(seq, start, out)
        if seq.fork_at is not None and computed >= seq.fork_at:
            for sample in self._holds.release(seq):
                _insert(self.running, sample)
                self.forks.append((seq_id, sample.seq_id))
        if out is None or not out.sampled:
            return
        beams = self.beams
        if beams and seq.request_id in beams:
            updates.extend(self._beams.report(seq, out.top_logprobs))
            return
        token, sp, output = out.token_id, seq.sampling, seq.output_token_ids
        output.append(token)
        if token in sp.stop_token_ids or (not sp.ignore_eos and token in self.eos_token_ids):
            reason = "stop"
        elif seq.tokens_left() <= 0:
            reason = "length"
        else:
            reason = None
        if reason:
            self.drop(seq)
            seq.finish(reason)
        first = seq.prompt_logprobs if len(output) == 1 else None
        updates.append(SeqUpdate(seq, token, out.logprob, out.top_logprobs, bool(reason), first))

    def _stop_tokens(self, sp: SamplingParams) -> frozenset[int]:
        """The tokens that stop a sequence sampled so, as `_sampled` tells them."""
        return frozenset(sp.stop_token_ids).union(() if sp.ignore_eos else self.eos_token_ids)

    def _prompt_logprobs(self, seq: Sequence, start: int, out: SampleOutput | None) -> None:
        """Keep a step's prompt logprobs (once: a recompute's again are skipped); once every
        prompt position is scored, stop asking (a recompute then computes none and may use
        the prefix cache)."""
        if out is not None and out.prompt_logprobs:
            seq.add_prompt_logprobs(start + 1, out.prompt_logprobs)
        if seq.sampling.prompt_logprobs is not None and len(seq.prompt_logprobs) >= len(seq.prompt_token_ids) - 1:
            seq.sampling = dataclasses.replace(seq.sampling, prompt_logprobs=None)

    def release_idle_beams(self) -> bool:
        """Free the blocks of beams that wait for their siblings (Beams.release_idle); True if any."""
        n = self._beams.release_idle()
        self.num_beam_releases += n
        return n > 0

    def enqueue(self, seq: Sequence) -> None:
        """Queue a known sequence by its status: waiting (to compute from scratch) or running."""
        _insert(self.waiting if seq.status is SeqStatus.WAITING else self.running, seq)

    def drop(self, seq: Sequence) -> None:
        """Forget a sequence; memsvc frees its blocks at the next reserve."""
        for queue in (self.waiting, self.running, self.swapped):
            if seq in queue:
                queue.remove(seq)
        self._remove(seq.seq_id)
        if seq.status in (SeqStatus.RUNNING, SeqStatus.SWAPPED):
            self.to_free.append(seq.seq_id)

    def release(self, seq: Sequence) -> None:
        """Take a running sequence off the device: memsvc frees its blocks at the next
        reserve; it is WAITING, to be recomputed once queued again (`enqueue`)."""
        self.running.remove(seq)
        self.to_free.append(seq.seq_id)
        seq.status, seq.num_computed = SeqStatus.WAITING, 0

    def _remove(self, seq_id: str) -> None:
        """Take a sequence out of `seqs` (the one place: while `_removals` stays, every
        sequence found in `seqs` once is still there)."""
        del self.seqs[seq_id]
        self._removals += 1

    def _end_held(self, parent_id: str, reason: str, error: str | None = None) -> None:
        """The samples a parent holds end with it, before they fork."""
        for sample in self._holds.take(parent_id):
            if sample.seq_id in self.seqs:
                self._remove(sample.seq_id)
            sample.finish(reason, error)
