"""The batching loop of one executor replica: requests in, deltas out, one step at a time.

`_serial_step`: plan (scheduler) -> reserve (memsvc) -> execute (executor) -> apply the
tokens (gateway.requests turns them into deltas). With `SchedulerConfig.overlap`,
`_overlapped_step` keeps the executor fed instead: while step N runs it plans step N + 1
and sends its Reserve (gateway.plan_ahead: the executor feeds itself the tokens N samples,
wire.step_feed), turns step N - 1's tokens into deltas while memsvc answers, sends N + 1 to
the executor, then applies N's. Where the next
plan depends on more than token counts (forks, beam search, swapped-out sequences) or
memsvc defers it, nothing goes ahead. Outputs are the serial loop's. Finished sequences are
freed by the next reserve; the executor hears of them with the next batch (`forget`). The
loop is synchronous, driven from one thread (gateway.step_runner). Each plan tells memsvc
which of its steps ran (gateway.write_report), so that only written blocks become prefix
hits; a sequence the executor leaves out of a step ends alone (its request gets an error),
the others go on. See docs/ARCHITECTURE.md, "The step path".
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from gateway.beam_search import BeamDone
from gateway.plan_ahead import Ahead, PlanAhead
from gateway.requests import Requests
from gateway.scheduler import Scheduler, SchedulerConfig, SeqUpdate
from gateway.step_pipeline import InFlight, StepPipeline
from gateway.write_report import WriteReport
from wire.clients import ExecutorClient, MemoryClient
from wire.protocol import Delta, Plan, ReserveResult, SampleOutput, SamplingParams
from wire.ordered_executor import OrderedExecutor
from wire.step_delta import StepDelta
from wire.step_feed import lost_feed


@dataclass
class StepTimes:
    """Wall seconds the loop spent per phase, summed over `steps` (perf_counter, cheap
    enough to stay on): scheduling (plan, applying memsvc's answer), Reserve (forks
    included: the wire and memsvc), Execute (the wire and the executor) and outputs (applying the
    tokens, detokenizing, stop rules, deltas)."""

    steps: int = 0
    schedule: float = 0.0
    reserve: float = 0.0
    execute: float = 0.0
    output: float = 0.0

    def clear(self) -> None:
        self.steps, self.schedule, self.reserve, self.execute, self.output = 0, 0.0, 0.0, 0.0, 0.0


class BatchLoop:
    def __init__(self, memory: MemoryClient, executor: ExecutorClient, config: SchedulerConfig,
                 tokenizer=None):
        self.memory = memory
        self.executor = executor
        self.info = executor.model_info()
        self.tokenizer = tokenizer
        self.scheduler = Scheduler(config, self.info.eos_token_ids, self.info.kv.block_size)
        self._requests = Requests(self.scheduler, self.info, tokenizer)
        self.num_steps = 0
        self._last_step = (0, 0.0)  # tokens computed, executor seconds
        self.times = StepTimes()
        self._forget: list[str] = []  # for the executor: finished or preempted since its last batch
        self.overlap = config.overlap
        self.plan_ahead = config.overlap and config.plan_ahead
        # an executor with `feeds_itself` runs numbered steps in order and fills FED tokens
        # (the executor service does); any other is run through OrderedExecutor
        feeds = getattr(executor, "feeds_itself", False)
        self._stepper = executor if feeds else OrderedExecutor(executor)  # takes StepDelta
        self.pipeline = StepPipeline(self._stepper)
        self.report = WriteReport()
        self.ahead = PlanAhead(self.scheduler, memory, self.report.answered)
        self.num_resent = 0  # steps sent ahead that failed and ran again
        self._unapplied: list[SeqUpdate | BeamDone] = []  # overlap: the last step's, not yet deltas
        self._ready: list[Delta] = []
        self.deliver = None  # overlap: called with the deltas made while the executor runs

    @property
    def num_ahead(self) -> int:  # plans reserved ahead
        return self.ahead.num_ahead

    @property
    def num_deferred(self) -> int:  # of them, deferred by memsvc
        return self.ahead.num_deferred

    @property
    def requests(self) -> dict:  # request id -> gateway.requests.RequestState, while it runs
        return self._requests.by_id

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                    **options) -> None:
        """Check and queue a request (gateway.requests.Requests.add); RequestError naming
        the bad field."""
        self._requests.add(request_id, prompt_token_ids, sampling, **options)

    def abort(self, request_id: str) -> None:
        self._requests.abort(request_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._unapplied) or bool(self.pipeline.inflight)

    def close(self) -> None:
        self.pipeline.close()
        self.ahead.close()

    def request_of(self, seq_id: str) -> str | None:
        """The request of a sequence this loop holds (None once it is gone)."""
        seq = self.scheduler.seqs.get(seq_id)
        return seq.request_id if seq is not None else None

    def step(self) -> list[Delta]:
        try:
            deltas = self._overlapped_step() if self.overlap else self._serial_step()
        except BaseException:  # a Reserve answered but lost, a step not run: none counts as written
            self.report.gave_up()
            raise
        if self._ready:  # made by a step that then failed
            deltas, self._ready = self._ready + deltas, []
        return deltas

    def _serial_step(self) -> list[Delta]:
        """Plan, reserve, execute, apply: one after the other."""
        batch, deltas = self._plan_and_reserve()
        if batch is None:
            return deltas
        batch.forget, self._forget = self._forget, []
        t0 = time.perf_counter()
        try:
            outputs = self._stepper.execute(batch)
        except BaseException:
            self._failed(batch)
            raise
        t1 = time.perf_counter()
        self._executed(batch, t1 - t0)
        self.times.execute += t1 - t0
        deltas.extend(self._deltas(self._on_sampled(batch, outputs)))
        self.times.output += time.perf_counter() - t1
        return deltas

    def _overlapped_step(self) -> list[Delta]:
        """Step N runs; with plan ahead, step N + 1 is planned and its Reserve sent, step N - 1's
        outputs become deltas while memsvc answers, and N + 1 goes to the executor, which
        starts it the moment N ends; then N's tokens are applied. Returns N - 1's deltas (or
        hands them to `deliver`)."""
        pipe, clock, times = self.pipeline, time.perf_counter, self.times
        deltas: list[Delta] = []
        if not pipe.inflight:
            batch, deltas = self._plan_and_reserve()
            if batch is None:
                return deltas
            self._send(batch, fed=False)
        running = pipe.inflight[0]
        ahead = None
        try:
            if self.plan_ahead and not running.failed():  # else it runs again first: none ahead of it
                ahead = self._reserve_ahead(running.batch)
            t0 = clock()
            deltas += self._deltas(self._take_unapplied())  # while the executor runs, memsvc reserves
            times.output += clock() - t0
            if ahead is not None:
                deltas += self._send_ahead(ahead, running.batch)
        except BaseException:  # the step fails as a failed Reserve would; the batch ends first
            if ahead is not None:
                ahead.result.exception()  # not left running
            self._ready.extend(deltas)
            self._void()
            raise
        t1 = clock()
        if self.deliver is not None:
            self.deliver(deltas)
            deltas = []
        try:
            outputs, seconds = self._result(running)
        except BaseException:
            self._ready.extend(deltas)
            self._failed(running.batch)
            self._void()
            raise
        t2 = clock()
        times.execute += t2 - t1
        self._executed(running.batch, seconds)
        self._unapplied = self._on_sampled(running.batch, outputs)
        times.output += clock() - t2
        return deltas

    def _send(self, batch: StepDelta, fed: bool) -> None:
        batch.forget, self._forget = self._forget, []
        self.pipeline.send(batch, fed)

    def _reserve_ahead(self, running: StepDelta) -> Ahead | None:
        """While `running` runs: plan the step after it and send its Reserve."""
        t0 = time.perf_counter()
        ahead = self.ahead.reserve(running, self._prepare)
        self.times.schedule += time.perf_counter() - t0
        return ahead

    def _send_ahead(self, ahead: Ahead, running: StepDelta) -> list[Delta]:
        """Apply memsvc's answer to a plan made ahead of `running` and send the step (nothing
        sent: not granted, the next step is planned once this one is done). Rejections'
        deltas."""
        t0 = time.perf_counter()
        result = self.ahead.answer(ahead)
        t1 = time.perf_counter()
        self.times.reserve += t1 - t0
        if result is None:
            return []
        batch, rejected = self.scheduler.on_reserved(result, ahead_of=running)
        batch.stamp = result.stamp
        self._forget.extend(p.seq_id for p in result.preempted)
        deltas = [d for d in (self._rejected(seq) for seq in rejected) if d]
        if batch.num_seqs():
            self._send(batch, fed=True)
        self.times.schedule += time.perf_counter() - t1
        return deltas

    def _result(self, step: InFlight) -> tuple[list[SampleOutput], float]:
        """A step's outputs; a step sent ahead that failed (the executor did not hold a
        token it was to feed itself: it restarted, or the step before failed) runs again
        with its tokens, known now."""
        try:
            return self.pipeline.wait(step)
        except Exception as e:
            if not (step.fed and lost_feed(e)):
                raise
        t0 = time.perf_counter()
        self.num_resent += 1
        outputs = self.pipeline.resend(step)
        return outputs, time.perf_counter() - t0

    def _on_sampled(self, batch: StepDelta, outputs: list[SampleOutput]) -> list[SeqUpdate | BeamDone]:
        updates = self.scheduler.on_sampled(batch, outputs)
        if self.scheduler.left_out:
            self.report.left_out(self.scheduler.left_out)
            self.scheduler.left_out = []
        return updates

    def _executed(self, batch: StepDelta, seconds: float) -> None:
        self.report.ran(batch)
        self._last_step = (len(batch.token_ids), seconds)
        self.times.steps += 1
        self.num_steps += 1

    def _plan_and_reserve(self) -> tuple[StepDelta | None, list[Delta]]:
        """Plan and reserve the next step after the last one's tokens are applied: the batch
        (None: nothing to run now) and deltas (rejections; earlier steps' tokens when no
        batch runs)."""
        clock, times = time.perf_counter, self.times
        t0 = clock()
        plan = self.scheduler.plan()
        if plan.empty():
            return None, self._deltas(self._take_unapplied())
        result = self._reserve(plan, t0)
        t2 = clock()
        batch, rejected = self.scheduler.on_reserved(result)
        batch.stamp = result.stamp
        self._forget.extend(p.seq_id for p in result.preempted)
        deltas = [d for d in (self._rejected(seq) for seq in rejected) if d]
        times.schedule += clock() - t2
        if batch.num_seqs():
            return batch, deltas
        earlier = self._take_unapplied()
        stuck = not (plan.free or result.preempted or result.rejected or earlier)  # the next try is the same
        if stuck and not self.scheduler.release_idle_beams():
            raise RuntimeError("scheduler stalled: requests wait but nothing can run")
        return None, deltas + self._deltas(earlier)

    def _prepare(self, plan: Plan) -> None:
        """`plan` carries the last step's report; the executor hears of the sequences it frees
        with the next batch."""
        plan.step_tokens, plan.step_seconds = self._last_step
        self._last_step = (0, 0.0)
        self._forget.extend(plan.free)
        self.report.put(plan)

    def _reserve(self, plan: Plan, planned_since: float) -> ReserveResult:
        """Reserve `plan`; times planning (since `planned_since`) and the Reserve."""
        self._prepare(plan)
        t1 = time.perf_counter()
        result = self.memory.reserve(plan)
        self.report.answered(plan, result)
        self.times.schedule += t1 - planned_since
        self.times.reserve += time.perf_counter() - t1
        return result

    def _failed(self, batch: StepDelta) -> None:
        """The executor did not run `batch`: it hears of its forgets again, and memsvc that
        nothing reserved since the last step that ran will run (gateway.write_report)."""
        self._forget[:0] = batch.forget
        self.report.gave_up()

    def _void(self) -> None:
        """A step failed: wait for the steps still in flight; they count as not run."""
        self.scheduler.planned = None
        for step in reversed(self.pipeline.drain()):
            self._failed(step.batch)

    def _take_unapplied(self) -> list[SeqUpdate | BeamDone]:
        updates, self._unapplied = self._unapplied, []
        return updates

    def _deltas(self, updates: list[SeqUpdate | BeamDone]) -> list[Delta]:
        return self._requests.deltas(updates)

    def _rejected(self, seq) -> Delta | None:
        return self._requests.rejected(seq)
