"""Continuous batching at the iteration level: which sequences compute which tokens this step.

The scheduler proposes (a plan in priority order: running, swapped-out to resume, waiting),
memsvc decides what fits (grants, preemptions by swap or recompute, resumptions), the
executor computes, and the scheduler applies the sampled tokens. This module holds the
queues and the step's three phases, `plan`, `on_reserved` and `on_sampled`; each takes the
steady-decode fast path where the step is one (pagedserve.gateway.steady_decode) and the
general path otherwise (general_plan; preemptions, granted_step; general_sampled). A
sequence leaves through seq_end.

Sharing: a request with n > 1 samples prefills one sequence up to its last prompt token,
then forks the others from it (pagedserve.gateway.samples; memsvc Fork: the prompt's blocks are shared,
the partial last one copied on write). Beam search (pagedserve.gateway.beam_search) forks a beam for
each extra continuation of a parent and frees the beams that are pruned. Forks are queued
in `forks` and travel in the next plan (`Plan.forks`): memsvc makes them before it frees
anything. The scheduler holds no block table: memsvc's grants (pagedserve.wire.reserve_messages.Grants) go on
as the step's columns (pagedserve.wire.step_delta), block-table changes included, and whoever runs
the model applies them and derives the slots. See docs/ARCHITECTURE.md, "One step".
"""
from __future__ import annotations

from pagedserve.gateway import general_plan, general_sampled, granted_step, preemptions, seq_end, steady_decode
from pagedserve.gateway.beam_search import Beams, BeamSearch
from pagedserve.gateway.pending_tokens import PendingTokens
from pagedserve.gateway.samples import SampleHolds
from pagedserve.gateway.scheduler_config import SchedulerConfig
from pagedserve.gateway.seq_queue import insert
from pagedserve.gateway.seq_update import SeqUpdate
from pagedserve.gateway.sequence import SeqStatus, Sequence
from pagedserve.gateway.step_records import Planned, Took
from pagedserve.gateway.step_updates import StepUpdates
from pagedserve.wire.pending_token import PENDING
from pagedserve.wire.protocol import SampleOutput
from pagedserve.wire.step_outputs import StepOutputs
from pagedserve.wire.reserve_messages import Plan, ReserveResult
from pagedserve.wire.step_delta import StepDelta


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
        self.failed_alone: list[SeqUpdate] = []  # for the next on_sampled to return
        self.holds = SampleHolds()
        self.beam_searches = Beams(self)
        self.num_preemptions = 0
        self.num_swapped_out = 0
        self.num_beam_releases = 0
        self.pending = PendingTokens()  # plan ahead: tokens memsvc holds whose ids it lacks
        self.planned: Planned | None = None  # the last plan, made ahead, for the answer to it
        self.took: Took | None = None  # the last on_sampled's
        self.removals = 0  # sequences taken out of `seqs` so far (seq_end.remove)

    @property
    def held(self) -> dict[str, list[Sequence]]:  # parent id -> samples forked at its fork point
        return self.holds.held

    @property
    def beams(self) -> dict[str, BeamSearch]:  # request id -> its beam search
        return self.beam_searches.searches

    def add(self, seq: Sequence, samples: list[Sequence] | None = None) -> None:
        """Queue `seq`; `samples` (the request's other n - 1) fork from it after its prefill."""
        for s in [seq, *(samples or [])]:
            if s.seq_id in self.seqs:
                raise ValueError(f"sequence {s.seq_id} already exists")
        self.seqs[seq.seq_id] = seq
        insert(self.waiting, seq)
        if not samples:
            return
        for s in samples:
            self.seqs[s.seq_id] = s
        if not self.holds.hold(seq, samples):
            for s in samples:
                insert(self.waiting, s)

    def add_beam_search(self, seq: Sequence, search: BeamSearch) -> None:
        self.add(seq)
        self.beams[seq.request_id] = search

    def abort(self, seq_id: str, reason: str = "abort") -> Sequence | None:
        """Stop a sequence; its blocks are freed by the next reserve."""
        return seq_end.abort(self, seq_id, reason)

    def abort_request(self, request_id: str, reason: str = "abort") -> None:
        seq_end.abort_request(self, request_id, reason)

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
        took = self.took
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
            run_ids, run_counts, run_tokens, budget = general_plan.running(self, ahead_of, budget, max_seqs)
        entries = general_plan.waiting(self, budget, max_seqs - len(run_ids)) if self.waiting else []
        plan = Plan(entries=entries, free=self.to_free, forks=self.forks, ahead=ahead_of is not None,
                    fills=fills, run_ids=run_ids, run_counts=run_counts, run_tokens=run_tokens)
        if plan.ahead:
            ids = plan.seq_ids()
            if steady is not None and not entries:  # the running sequences, current (`_steady_run`)
                planned = list(self.running)
            else:
                planned = list(map(self.seqs.__getitem__, ids))
            self.planned = Planned(ids, planned, ahead_of, fed_ends, self.removals)
        else:
            self.planned = None
        self.to_free, self.forks = [], []
        return plan

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
        if result.preempted or result.resumed:
            preemptions.apply(self, result)
        planned, self.planned = self.planned, None
        rejected = granted_step.reject(self, result.rejected, planned) if result.rejected else []
        g = result.grants
        seqs = self._granted_as_planned(planned, g.seq_ids)
        if seqs is None:
            seqs, ended, fed_ends = granted_step.sequences(self, g.seq_ids, planned, ahead_of)
        else:
            ended, fed_ends = False, planned.fed_ends if planned.ahead_of is ahead_of else None
        step = StepDelta(g.seq_ids, g.start_pos, g.num_tokens, [], [], g.table_start, g.num_new_blocks,
                         g.new_blocks, seqs, pool_epoch=result.pool_epoch, copies=result.block_copies)
        cached = g.num_cached
        if ended:  # since a plan made ahead: memsvc frees it next
            step, cached = granted_step.without_ended(self, step, cached)
        if ahead_of is not None and self._all_fed(step, ahead_of, fed_ends):
            n = len(step.seq_ids)
            step.token_ids, step.sample = [PENDING] * n, [True] * n
        else:
            granted_step.tokens(self, step, cached, ahead_of.progress() if ahead_of is not None else None)
        return step, rejected

    def on_sampled(self, batch: StepDelta, outputs: StepOutputs | list[SampleOutput]) -> StepUpdates:
        """Apply a step's outputs to the sequences it was made for (a sequence that ended
        since, its id maybe reused by a new request, gets nothing)."""
        updates = StepUpdates()
        outputs = StepOutputs.of(outputs)
        if not self._sampled_in_order(batch, outputs, updates):
            self.took = None
            general_sampled.by_id(self, batch, outputs, updates)
        if self.failed_alone:
            updates.extend(self.failed_alone)
            self.failed_alone = []
        return updates

    # the steady-decode fast paths (pagedserve.gateway.steady_decode); a test declines them here

    def _steady_run(self, ahead_of: StepDelta, took: Took, budget: int, max_seqs: int):
        return steady_decode.steady_run(self, ahead_of, took, budget, max_seqs)

    def _granted_as_planned(self, planned: Planned | None, seq_ids: list[str]) -> list[Sequence] | None:
        return steady_decode.granted_as_planned(self, planned, seq_ids)

    def _all_fed(self, step: StepDelta, ahead_of: StepDelta, ends: list[int] | None = None) -> bool:
        return steady_decode.all_fed(step, ahead_of, ends)

    def _sampled_in_order(self, batch: StepDelta, outputs: StepOutputs, updates: StepUpdates) -> bool:
        return steady_decode.sampled_in_order(self, batch, outputs, updates)

    def _sampled_steady(self, batch: StepDelta, outputs: StepOutputs, took: Took, updates: StepUpdates) -> bool:
        return steady_decode.sampled_steady(self, batch, outputs, took, updates)

    # for beam search (pagedserve.gateway.beam_search.BeamHost)

    def release_idle_beams(self) -> bool:
        """Free the blocks of beams that wait for their siblings (Beams.release_idle); True if any."""
        n = self.beam_searches.release_idle()
        self.num_beam_releases += n
        return n > 0

    def enqueue(self, seq: Sequence) -> None:
        """Queue a known sequence by its status: waiting (to compute from scratch) or running."""
        insert(self.waiting if seq.status is SeqStatus.WAITING else self.running, seq)

    def drop(self, seq: Sequence) -> None:
        """Forget a sequence; memsvc frees its blocks at the next reserve."""
        seq_end.drop(self, seq)

    def release(self, seq: Sequence) -> None:
        """Take a running sequence off the device: memsvc frees its blocks at the next
        reserve; it is WAITING, to be recomputed once queued again (`enqueue`)."""
        seq_end.release(self, seq)
