"""The batching loop of one executor replica: requests in, deltas out, one step at a time.

One step: plan (scheduler) -> reserve (memsvc) -> execute (executor) -> apply tokens,
detokenize, apply stop rules. Finished and cancelled sequences are freed in the next
reserve. The loop is synchronous; the gRPC gateway drives it from its event loop.
"""
from __future__ import annotations

import hashlib
import secrets
import time
from dataclasses import dataclass, field

from gateway.clients import ExecutorClient, MemoryClient
from gateway.output_stream import Delta, OutputStream
from gateway.scheduler import Scheduler, SchedulerConfig, SeqUpdate
from gateway.sequence import Sequence
from pagedserve.protocol import SamplingParams


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


class BatchLoop:
    def __init__(self, memory: MemoryClient, executor: ExecutorClient, config: SchedulerConfig,
                 tokenizer=None):
        self.memory = memory
        self.executor = executor
        self.info = executor.model_info()
        self.tokenizer = tokenizer
        self.scheduler = Scheduler(config, self.info.eos_token_ids)
        self.requests: dict[str, _RequestState] = {}
        self.num_steps = 0

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
        state = _RequestState(request_id, len(prompt_token_ids), [], [])
        for i in range(sampling.n):
            seq = Sequence(f"{request_id}/{i}", request_id, i, list(prompt_token_ids), sampling,
                           derive_seed(seed, i), max_len, arrival, priority, final_len, salt)
            state.seqs.append(seq)
            state.streams.append(OutputStream(self.tokenizer, prompt_token_ids, sampling.stop))
            state.open.add(i)
            self.scheduler.add(seq)
        self.requests[request_id] = state

    def abort(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        if state is not None:
            for seq in state.seqs:
                self.scheduler.abort(seq.seq_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[Delta]:
        plan = self.scheduler.plan()
        if not plan.entries and not plan.free:
            return []
        result = self.memory.reserve(plan)
        batch, rejected = self.scheduler.on_reserved(result)
        deltas = [self._rejected(seq) for seq in rejected]
        if not batch.seqs:
            if self.scheduler.waiting and not self.scheduler.running and not plan.free:
                raise RuntimeError("scheduler stalled: waiting requests but nothing can run")
            return [d for d in deltas if d]
        outputs = self.executor.execute(batch)
        self.num_steps += 1
        for update in self.scheduler.on_sampled(batch, outputs):
            delta = self._apply(update)
            if delta is not None:
                deltas.append(delta)
        return [d for d in deltas if d]

    def _apply(self, update: SeqUpdate) -> Delta | None:
        seq = update.seq
        state = self.requests.get(seq.request_id)
        if state is None:
            return None
        stream = state.streams[seq.index]
        text = stream.add(update.token_id)
        finish = seq.finish_reason if update.finished else None
        if stream.stopped and not update.finished:
            self.scheduler.abort(seq.seq_id, "stop")
            finish = "stop"
        if finish:
            text += stream.flush()
            self._close(state, seq.index)
        return Delta(
            request_id=seq.request_id, index=seq.index, text=text, token_ids=[update.token_id],
            finish_reason=finish,
            logprobs=[update.logprob] if update.logprob is not None else [],
            top_logprobs=[update.top_logprobs] if update.top_logprobs else [],
            prompt_tokens=state.prompt_len, completion_tokens=len(seq.output_token_ids),
            cached_tokens=max(seq.num_cached_tokens, 0),
        )

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
