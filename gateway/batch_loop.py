"""The batching loop of one executor replica: requests in, deltas out, one step at a time.

One step: plan (scheduler) -> reserve (memsvc) -> execute (executor) -> apply tokens,
detokenize, apply stop rules. Finished and cancelled sequences are freed, and the forks a
step queued (n > 1 samples, beams) made, by the next reserve, which also reports the
previous step's computed tokens and executor seconds (memsvc's recompute cost); the
executor hears of finished and preempted sequences with the next batch (`forget`). Beam
search streams nothing until it ends; then each of its n best completions comes as one
delta, best first (index 0). The loop is synchronous; the gateway drives it from one thread
(gateway.step_runner).

`_serial_step` does the four one after the other. With `SchedulerConfig.overlap`,
`_overlapped_step` keeps the executor fed instead (docs/ARCHITECTURE.md, "The step path"):
while step N runs it plans and reserves step N + 1 as if N's tokens were computed
(`Scheduler.plan(ahead_of=)`, plan_ahead) and sends it at once, naming each token N
samples as the executor's own (wire.step_feed.FED), so the executor starts N + 1 the
moment N ends; then it turns step N - 1's tokens into deltas (handed to `deliver` at once
when set), and applies N's tokens when N returns. Where the next plan depends on more than
token counts (forks, beam search, swapped-out sequences) or memsvc defers it (it would copy
blocks or preempt while steps use the pool), nothing goes ahead: the next step is planned
once N is done, as in the serial loop. Outputs are the serial loop's: a sequence that ends
by EOS or a stop token at N computes one token in N + 1 for nothing (a stop string: two,
as it is seen when N's deltas are made), and it is dropped.
"""
from __future__ import annotations

import hashlib
import secrets
import time
from dataclasses import dataclass, field

from gateway.beam_search import BeamSearch, beam_sampling
from gateway.output_stream import OutputStream
from wire.protocol import Delta
from gateway.scheduler import BeamDone, Scheduler, SchedulerConfig, SeqUpdate
from gateway.sequence import Sequence
from gateway.step_pipeline import InFlight, StepPipeline
from wire.clients import ExecutorClient, MemoryClient
from wire.protocol import Plan, ReserveResult, SampleOutput, SamplingParams, StepBatch
from wire.step_feed import OrderedExecutor, lost_feed


class RequestError(ValueError):
    """A request the gateway refuses; the message names the field to change."""


def derive_seed(seed: int, index: int) -> int:
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass
class _RequestState:
    request_id: str
    prompt_len: int
    seqs: list[Sequence]
    streams: list[OutputStream]
    open: set[int] = field(default_factory=set)
    sampling: SamplingParams | None = None  # as the request asked


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
        self.requests: dict[str, _RequestState] = {}
        self.num_steps = 0
        self._last_step = (0, 0.0)  # tokens computed, executor seconds
        self.times = StepTimes()
        self._forget: list[str] = []  # for the executor: finished or preempted since its last batch
        self.overlap = config.overlap
        self.plan_ahead = config.overlap and config.plan_ahead
        # an executor with `feeds_itself` runs numbered steps in order and fills FED tokens
        # (the executor service does); any other is run through OrderedExecutor
        feeds = getattr(executor, "feeds_itself", False)
        self.pipeline = StepPipeline(executor if feeds else OrderedExecutor(executor))
        self.num_ahead = 0  # plans made ahead, and of them deferred by memsvc
        self.num_deferred = 0
        self.num_resent = 0  # steps sent ahead that failed and ran again
        self._unapplied: list[SeqUpdate | BeamDone] = []  # overlap: the last step's, not yet deltas
        self._ready: list[Delta] = []
        self.deliver = None  # overlap: called with the deltas made while the executor runs

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                    *, priority: int = 0, final_len: int | None = None, salt: str | None = None,
                    arrival: float | None = None) -> None:
        """Validate and queue a request; raises RequestError naming the bad field."""
        if request_id in self.requests:
            raise RequestError(f"request_id {request_id!r} is already in use")
        self._validate(prompt_token_ids, sampling)
        seed = sampling.seed if sampling.seed is not None else secrets.randbits(63)
        max_len = min(len(prompt_token_ids) + sampling.max_tokens, self.info.max_model_len)
        arrival = time.monotonic() if arrival is None else arrival
        state = _RequestState(request_id, len(prompt_token_ids), [], [], sampling=sampling)
        for i in range(sampling.n):
            state.streams.append(OutputStream(self.tokenizer, prompt_token_ids, sampling.stop))
            state.open.add(i)
        if sampling.beam_search:
            self._add_beam_search(state, list(prompt_token_ids), sampling, seed, max_len, arrival,
                                  priority, final_len, salt)
        else:
            for i in range(sampling.n):
                state.seqs.append(Sequence(f"{request_id}/{i}", request_id, i, list(prompt_token_ids),
                                           sampling, derive_seed(seed, i), max_len, arrival, priority,
                                           final_len, salt))
            self.scheduler.add(state.seqs[0], state.seqs[1:])
        self.requests[request_id] = state

    def _add_beam_search(self, state: _RequestState, prompt: list[int], sampling: SamplingParams,
                         seed: int, max_len: int, arrival: float, priority: int,
                         final_len: int | None, salt: str | None) -> None:
        eos = set(self.info.eos_token_ids)
        stop_ids = set(sampling.stop_token_ids)

        def is_stop(token: int) -> bool:
            return token in stop_ids or (not sampling.ignore_eos and token in eos)

        seq_id = f"{state.request_id}/b0"
        search = BeamSearch(sampling, seq_id, max_new_tokens=max_len - len(prompt), is_stop=is_stop,
                            num_eos=len(eos))
        seq = Sequence(seq_id, state.request_id, 0, prompt, beam_sampling(sampling, search.num_candidates),
                       seed, max_len, arrival, priority, final_len, salt)
        state.seqs.append(seq)
        self.scheduler.add_beam_search(seq, search)

    def abort(self, request_id: str) -> None:
        if self.requests.pop(request_id, None) is not None:
            self.scheduler.abort_request(request_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._unapplied) or bool(self.pipeline.inflight)

    def close(self) -> None:
        self.pipeline.close()

    def request_of(self, seq_id: str) -> str | None:
        """The request of a sequence this loop holds (None once it is gone)."""
        seq = self.scheduler.seqs.get(seq_id)
        return seq.request_id if seq is not None else None

    def step(self) -> list[Delta]:
        deltas = self._overlapped_step() if self.overlap else self._serial_step()
        if self._ready:  # made by a step that then failed
            deltas, self._ready = self._ready + deltas, []
        return deltas

    def _serial_step(self) -> list[Delta]:
        """Plan, reserve, execute, apply: one after the other."""
        batch, deltas = self._plan_and_reserve()
        if batch is None:
            return deltas
        batch.forget, self._forget = self._forget, []
        seqs = [self.scheduler.seqs[s.seq_id] for s in batch.seqs]
        t0 = time.perf_counter()
        try:
            outputs = self.executor.execute(batch)
        except BaseException:
            self._failed(batch)
            raise
        t1 = time.perf_counter()
        self._executed(batch, t1 - t0)
        self.times.execute += t1 - t0
        deltas.extend(self._deltas(self.scheduler.on_sampled(batch, outputs, seqs)))
        self.times.output += time.perf_counter() - t1
        return deltas

    def _overlapped_step(self) -> list[Delta]:
        """Step N runs; with plan ahead, step N + 1 is planned, reserved and sent now, so
        the executor starts it the moment N ends; step N - 1's outputs become deltas; then
        N's tokens are applied. Returns N - 1's deltas (or hands them to `deliver`)."""
        pipe, clock, times = self.pipeline, time.perf_counter, self.times
        deltas: list[Delta] = []
        if not pipe.inflight:
            batch, deltas = self._plan_and_reserve()
            if batch is None:
                return deltas
            self._send(batch, fed=False)
        running = pipe.inflight[0]
        if self.plan_ahead and not running.failed():  # else it runs again first: none ahead of it
            try:
                deltas += self._send_ahead(running.batch)
            except BaseException:  # the step fails as a failed Reserve would; the batch ends first
                self._ready.extend(deltas)
                self._void()
                raise
        t0 = clock()
        deltas += self._deltas(self._take_unapplied())  # while the executor runs
        if self.deliver is not None:
            self.deliver(deltas)
            deltas = []
        t1 = clock()
        times.output += t1 - t0
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
        self._unapplied = self.scheduler.on_sampled(running.batch, outputs, running.seqs)
        times.output += clock() - t2
        return deltas

    def _send(self, batch: StepBatch, fed: bool) -> None:
        batch.forget, self._forget = self._forget, []
        self.pipeline.send(batch, [self.scheduler.seqs[s.seq_id] for s in batch.seqs], fed)

    def _send_ahead(self, running: StepBatch) -> list[Delta]:
        """While `running` runs: plan and reserve the step after it and send it (nothing
        sent: not granted, the next step is planned once this one is done). Rejections'
        deltas."""
        t0 = time.perf_counter()
        plan = self.scheduler.plan(ahead_of=running)
        if plan is None or not (plan.entries or plan.free or plan.fills):
            if plan is not None:
                self.scheduler.deferred(plan)
            return []
        result = self._reserve(plan, t0)
        self.num_ahead += 1
        if result.deferred:
            self.scheduler.deferred(plan)
            self.num_deferred += 1
            return []
        t1 = time.perf_counter()
        batch, rejected = self.scheduler.on_reserved(result, ahead_of=running)
        self._forget.extend(p.seq_id for p in result.preempted)
        deltas = [d for d in (self._rejected(seq) for seq in rejected) if d]
        if batch.seqs:
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

    def _executed(self, batch: StepBatch, seconds: float) -> None:
        self._last_step = (sum(len(s.token_ids) for s in batch.seqs), seconds)
        self.times.steps += 1
        self.num_steps += 1

    def _plan_and_reserve(self) -> tuple[StepBatch | None, list[Delta]]:
        """Plan and reserve the next step after the last one's tokens are applied: the batch
        (None: nothing to run now) and deltas (rejections; earlier steps' tokens when no
        batch runs)."""
        clock, times = time.perf_counter, self.times
        t0 = clock()
        plan = self.scheduler.plan()
        if not plan.entries and not plan.free and not plan.forks and not plan.fills:
            return None, self._deltas(self._take_unapplied())
        result = self._reserve(plan, t0)
        t2 = clock()
        batch, rejected = self.scheduler.on_reserved(result)
        self._forget.extend(p.seq_id for p in result.preempted)
        deltas = [d for d in (self._rejected(seq) for seq in rejected) if d]
        times.schedule += clock() - t2
        if batch.seqs:
            return batch, deltas
        earlier = self._take_unapplied()
        stuck = not (plan.free or result.preempted or result.rejected or earlier)  # the next try is the same
        if stuck and not self.scheduler.release_idle_beams():
            raise RuntimeError("scheduler stalled: requests wait but nothing can run")
        return None, deltas + self._deltas(earlier)

    def _reserve(self, plan: Plan, planned_since: float) -> ReserveResult:
        """Send `plan` with the last step's report; the executor hears of the sequences it
        frees with the next batch. Times planning (since `planned_since`) and the Reserve."""
        plan.step_tokens, plan.step_seconds = self._last_step
        self._last_step = (0, 0.0)
        self._forget.extend(plan.free)
        t1 = time.perf_counter()
        result = self.memory.reserve(plan)
        self.times.schedule += t1 - planned_since
        self.times.reserve += time.perf_counter() - t1
        return result

    def _failed(self, batch: StepBatch) -> None:
        """The executor did not run `batch`: it hears of its forgets again."""
        self._forget[:0] = batch.forget

    def _void(self) -> None:
        """A step failed: wait for the steps still in flight; they count as not run."""
        self.scheduler.planned = None
        for step in reversed(self.pipeline.drain()):
            self._failed(step.batch)

    def _take_unapplied(self) -> list[SeqUpdate | BeamDone]:
        updates, self._unapplied = self._unapplied, []
        return updates

    def _deltas(self, updates: list[SeqUpdate | BeamDone]) -> list[Delta]:
        deltas: list[Delta] = []
        for update in updates:
            if isinstance(update, BeamDone):
                deltas.extend(self._beam_done(update))
                continue
            delta = self._apply(update)
            if delta is not None:
                deltas.append(delta)
        return deltas

    def _apply(self, update: SeqUpdate) -> Delta | None:
        seq = update.seq
        state = self.requests.get(seq.request_id)
        if state is None:
            return None
        stream = state.streams[seq.index]
        if stream.stopped:  # overlap: a token computed before the stop string was seen
            return None
        text = stream.add(update.token_id)
        finish = seq.finish_reason if update.finished else None
        if stream.stopped and not update.finished:
            self.scheduler.abort(seq.seq_id, "stop")
            finish = "stop"
        if finish:
            text += stream.flush()
            self._close(state, seq.index)
        return Delta(seq.request_id, seq.index, text, [update.token_id], finish,
                     [update.logprob] if update.logprob is not None else [],
                     [update.top_logprobs] if update.top_logprobs else [],
                     update.prompt_logprobs or [], state.prompt_len, len(seq.output_token_ids),
                     seq.num_cached_tokens if seq.num_cached_tokens > 0 else 0)

    def _beam_done(self, done: BeamDone) -> list[Delta]:
        state = self.requests.pop(done.request_id, None)
        if state is None:
            return []
        want_logprobs = state.sampling.logprobs is not None
        deltas = []
        for i, stream in enumerate(state.streams):
            hyp = done.hypotheses[i] if i < len(done.hypotheses) else None
            tokens = hyp.token_ids if hyp else []
            text = "".join(stream.add(t) for t in tokens) + stream.flush()
            deltas.append(Delta(
                request_id=done.request_id, index=i, text=text, token_ids=tokens,
                finish_reason=hyp.finish_reason if hyp else "length",
                logprobs=hyp.logprobs if hyp and want_logprobs else [],
                prompt_tokens=state.prompt_len, completion_tokens=len(tokens),
                cached_tokens=done.cached_tokens,
            ))
        return deltas

    def _rejected(self, seq: Sequence) -> Delta | None:
        state = self.requests.get(seq.request_id)
        if state is None:
            return None
        self.abort(seq.request_id)
        return Delta(seq.request_id, seq.index, "", [], "error", prompt_tokens=state.prompt_len,
                     error=seq.error)

    def _close(self, state: _RequestState, index: int) -> None:
        state.open.discard(index)
        if not state.open:
            self.requests.pop(state.request_id, None)

    def _validate(self, prompt: list[int], sampling: SamplingParams) -> None:
        info = self.info
        if not prompt:
            raise RequestError("prompt is empty: send at least one token")
        if len(prompt) >= info.max_model_len:
            raise RequestError(
                f"prompt has {len(prompt)} tokens; the model's maximum length is "
                f"{info.max_model_len}, which must leave room for at least one new token"
            )
        bad = [t for t in prompt if not 0 <= t < info.vocab_size]
        if bad:
            raise RequestError(f"prompt_token_ids: {bad[0]} is outside the vocabulary [0, {info.vocab_size})")
        try:
            sampling.validate(info.max_model_len)
        except ValueError as e:
            raise RequestError(str(e)) from None
