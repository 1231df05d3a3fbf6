"""The batching loop of one executor replica: requests in, deltas out, one step at a time.

The phases (plan and reserve, send the step, its outputs, apply them, make deltas) run in
one of two orders. `_serial_step`: one after the other. With `SchedulerConfig.overlap`,
`_overlapped_step` keeps the executor fed: while step N runs it plans step N + 1 and sends
its Reserve (with `plan_ahead`; the executor feeds itself the tokens N samples,
pagedserve.wire.step_feed), turns step N - 1's tokens into deltas while memsvc answers, sends N + 1
to the executor, then applies N's; what carries over between steps is pagedserve.gateway.overlap.
Where the next plan depends on more than token counts (forks, beam search, swapped-out
sequences) or memsvc defers it, nothing goes ahead. Outputs are the serial loop's.
Finished sequences are freed by the next reserve; the executor hears of them with the next
batch (`forget`). The loop is synchronous, driven from one thread (pagedserve.gateway.step_runner).
Each plan tells memsvc which of its steps ran (pagedserve.gateway.write_report), so that only written
blocks become prefix hits; a sequence the executor leaves out of a step ends alone (its
request gets an error), the others go on. See docs/ARCHITECTURE.md, "The step path".
"""
from __future__ import annotations

import time
from concurrent.futures import Future

from pagedserve.gateway.in_process import step_clients
from pagedserve.gateway.overlap import InFlight, Overlap
from pagedserve.gateway.requests import Requests
from pagedserve.gateway.scheduler import Scheduler
from pagedserve.gateway.scheduler_config import SchedulerConfig
from pagedserve.gateway.step_times import StepTimes
from pagedserve.gateway.step_updates import StepUpdates
from pagedserve.gateway.write_report import WriteReport
from pagedserve.wire.clients import ExecutorClient, MemoryClient
from pagedserve.wire.protocol import Delta, SamplingParams
from pagedserve.wire.reserve_messages import Plan, ReserveResult
from pagedserve.wire.step_delta import StepDelta
from pagedserve.wire.step_outputs import StepOutputs


class BatchLoop:
    """`memory` and `executor`: clients (pagedserve.wire.clients), or objects in this process that
    pagedserve.gateway.in_process wraps. `step` calls the phases below in one of two orders:
    `_serial_step` or `_overlapped_step`; what carries over between steps is in `overlap`."""

    def __init__(self, memory: MemoryClient, executor: ExecutorClient, config: SchedulerConfig,
                 tokenizer=None):
        self.memory, self.executor = step_clients(memory, executor, config.overlap)
        self._wrapped = [c for c, given in ((self.memory, memory), (self.executor, executor)) if c is not given]
        self.info = self.executor.model_info()
        config = config.resolved(self.info.max_num_seqs)
        self.tokenizer = tokenizer
        self.scheduler = Scheduler(config, self.info.eos_token_ids, self.info.kv.block_size)
        self._requests = Requests(self.scheduler, self.info, tokenizer)
        self.num_steps = 0
        self._last_step = (0, 0.0)  # tokens computed, executor seconds
        self.times = StepTimes()
        self._forget: list[str] = []  # for the executor: finished or preempted since its last batch
        self.overlapped = config.overlap
        self.plan_ahead = config.overlap and config.plan_ahead
        self.overlap = Overlap()
        self.report = WriteReport()
        self.deliver = None  # overlap: called with the deltas made while the executor runs

    @property
    def num_ahead(self) -> int:  # plans reserved ahead
        return self.overlap.num_ahead

    @property
    def num_deferred(self) -> int:  # of them, deferred by memsvc
        return self.overlap.num_deferred

    @property
    def num_resent(self) -> int:  # steps sent ahead that failed and ran again
        return self.overlap.num_resent

    @property
    def requests(self) -> dict:  # request id -> pagedserve.gateway.requests.RequestState, while it runs
        return self._requests.by_id

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                    **options) -> None:
        """Check and queue a request (pagedserve.gateway.requests.Requests.add); RequestError naming
        the bad field."""
        self._requests.add(request_id, prompt_token_ids, sampling, **options)

    def abort(self, request_id: str) -> None:
        self._requests.abort(request_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self.overlap.unapplied) or bool(self.overlap.inflight)

    def close(self) -> None:
        """Stop the helper threads of the in-process clients this loop wrapped."""
        for client in self._wrapped:
            client.close()

    def request_of(self, seq_id: str) -> str | None:
        """The request of a sequence this loop holds (None once it is gone)."""
        seq = self.scheduler.seqs.get(seq_id)
        return seq.request_id if seq is not None else None

    def step(self) -> list[Delta]:
        try:
            deltas = self._overlapped_step() if self.overlapped else self._serial_step()
        except BaseException:  # a Reserve answered but lost, a step not run: none counts as written
            self.report.gave_up()
            raise
        if self.overlap.ready:  # made by a step that then failed
            deltas, self.overlap.ready = self.overlap.ready + deltas, []
        return deltas

    # the two orders

    def _serial_step(self) -> list[Delta]:
        """Plan, reserve, execute, apply: one after the other."""
        batch, deltas = self._plan_and_reserve()
        if batch is None:
            return deltas
        step = self._send(batch, fed=False)
        outputs = self._outputs(step)
        t0 = time.perf_counter()
        deltas += self._deltas(self._apply(batch, outputs))
        self.times.output += time.perf_counter() - t0
        return deltas

    def _overlapped_step(self) -> list[Delta]:
        """Step N runs; with plan ahead, step N + 1 is planned and its Reserve sent, step N - 1's
        outputs become deltas while memsvc answers, and N + 1 goes to the executor, which
        starts it the moment N ends; then N's tokens are applied. Returns N - 1's deltas (or
        hands them to `deliver`)."""
        state, clock, times = self.overlap, time.perf_counter, self.times
        deltas: list[Delta] = []
        if not state.inflight:
            batch, deltas = self._plan_and_reserve()
            if batch is None:
                return deltas
            self._send(batch, fed=False)
        running = state.inflight[0]
        ahead = None
        try:
            if self.plan_ahead and not running.failed():  # else it runs again first: none ahead of it
                ahead = self._reserve_ahead(running.batch)
            t0 = clock()
            deltas += self._deltas(state.take_unapplied())  # while the executor runs, memsvc reserves
            times.output += clock() - t0
            if ahead is not None:
                deltas += self._send_ahead(ahead, running.batch)
        except BaseException:  # the step fails as a failed Reserve would; the batch ends first
            if ahead is not None:
                ahead[1].exception()  # not left running
            state.ready.extend(deltas)
            self._void()
            raise
        if self.deliver is not None:
            self.deliver(deltas)
            deltas = []
        try:
            outputs = self._outputs(running)
        except BaseException:
            state.ready.extend(deltas)
            raise
        t2 = clock()
        state.unapplied = self._apply(running.batch, outputs)
        times.output += clock() - t2
        return deltas

    # the phases

    def _plan_and_reserve(self) -> tuple[StepDelta | None, list[Delta]]:
        """Plan and reserve the next step after the last one's tokens are applied: the batch
        (None: nothing to run now) and deltas (rejections; earlier steps' tokens when no
        batch runs)."""
        clock, times = time.perf_counter, self.times
        t0 = clock()
        plan = self.scheduler.plan()
        if plan.empty():
            return None, self._deltas(self.overlap.take_unapplied())
        self._prepare(plan)
        t1 = clock()
        result = self.memory.reserve(plan).result()
        self.report.answered(plan, result)
        t2 = clock()
        times.schedule += t1 - t0
        times.reserve += t2 - t1
        batch, deltas = self._granted(result)
        times.schedule += clock() - t2
        if batch.num_seqs():
            return batch, deltas
        earlier = self.overlap.take_unapplied()
        stuck = not (plan.free or result.preempted or result.rejected or earlier)  # the next try is the same
        if stuck and not self.scheduler.release_idle_beams():
            raise RuntimeError("scheduler stalled: requests wait but nothing can run")
        return None, deltas + self._deltas(earlier)

    def _reserve_ahead(self, running: StepDelta) -> tuple[Plan, Future] | None:
        """While `running` runs: plan the step after it and send its Reserve (None: nothing
        to reserve)."""
        t0 = time.perf_counter()
        plan = self.scheduler.plan(ahead_of=running)
        ahead = None
        if plan is None or plan.empty():
            if plan is not None:
                self.scheduler.deferred(plan)
        else:
            self._prepare(plan)
            ahead = plan, self.memory.reserve(plan)
        self.times.schedule += time.perf_counter() - t0
        return ahead

    def _send_ahead(self, ahead: tuple[Plan, Future], running: StepDelta) -> list[Delta]:
        """Apply memsvc's answer to a plan made ahead of `running` and send the step (nothing
        sent: not granted, or memsvc deferred the plan; the next step is planned once this
        one is done). Rejections' deltas."""
        plan, answer = ahead
        state, clock = self.overlap, time.perf_counter
        t0 = clock()
        result = answer.result()
        self.report.answered(plan, result)
        state.num_ahead += 1
        if result.deferred:
            self.scheduler.deferred(plan)
            state.num_deferred += 1
        t1 = clock()
        self.times.reserve += t1 - t0
        if result.deferred:
            return []
        batch, deltas = self._granted(result, ahead_of=running)
        self.times.schedule += clock() - t1
        if batch.num_seqs():
            self._send(batch, fed=True)
        return deltas

    def _granted(self, result: ReserveResult, ahead_of: StepDelta | None = None
                 ) -> tuple[StepDelta, list[Delta]]:
        """memsvc's answer applied: the batch to run, and the rejections' deltas."""
        batch, rejected = self.scheduler.on_reserved(result, ahead_of=ahead_of)
        batch.stamp = result.stamp
        self._forget.extend(p.seq_id for p in result.preempted)
        return batch, [d for d in (self._requests.rejected(seq) for seq in rejected) if d]

    def _send(self, batch: StepDelta, fed: bool) -> InFlight:
        """Put `batch` on its way to the executor, with what it is to forget."""
        t0 = time.perf_counter()
        batch.forget, self._forget = self._forget, []
        try:
            step = self.overlap.send(self.executor, batch, fed)
        except BaseException:  # not sent
            self._failed(batch)
            raise
        self.times.execute += time.perf_counter() - t0
        return step

    def _outputs(self, step: InFlight) -> StepOutputs:
        """The outputs of the oldest step in flight (pagedserve.gateway.overlap). A step that fails is
        not run, nor any step sent behind it."""
        t0 = time.perf_counter()
        try:
            outputs, seconds = self.overlap.outputs(self.executor, step)
        except BaseException:
            self._failed(step.batch)
            self._void()
            raise
        self.times.execute += time.perf_counter() - t0
        self.report.ran(step.batch)
        self._last_step = (len(step.batch.token_ids), seconds)
        self.times.steps += 1
        self.num_steps += 1
        return outputs

    def _apply(self, batch: StepDelta, outputs: StepOutputs) -> StepUpdates:
        """A step's tokens applied to its sequences: the updates to turn into deltas."""
        updates = self.scheduler.on_sampled(batch, outputs)
        if self.scheduler.left_out:
            self.report.left_out(self.scheduler.left_out)
            self.scheduler.left_out = []
        return updates

    def _deltas(self, updates: StepUpdates) -> list[Delta]:
        return self._requests.deltas(updates)

    def _prepare(self, plan: Plan) -> None:
        """`plan` carries the last step's report; the executor hears of the sequences it frees
        with the next batch."""
        plan.step_tokens, plan.step_seconds = self._last_step
        self._last_step = (0, 0.0)
        self._forget.extend(plan.free)
        self.report.put(plan)

    def _failed(self, batch: StepDelta) -> None:
        """The executor did not run `batch`: it hears of its forgets again, and memsvc that
        nothing reserved since the last step that ran will run (pagedserve.gateway.write_report)."""
        self._forget[:0] = batch.forget
        self.report.gave_up()

    def _void(self) -> None:
        """A step failed: wait for the steps still in flight; they count as not run."""
        self.scheduler.planned = None
        for step in reversed(self.overlap.drain()):
            self._failed(step.batch)
