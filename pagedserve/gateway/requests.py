"""The requests one batching loop serves: taken in (checked, turned into sequences for the
scheduler) and given back (each step's updates, pagedserve.gateway.step_updates, turned into
deltas: text, finish, logprobs, usage).

`Requests.add` (pagedserve.gateway.request_intake) raises RequestError naming the field to
change and queues nothing then. Beam search streams nothing until it ends; then each of its n best completions comes as
one delta, best first (index 0). A request is gone from `by_id` once every completion
ended or it was aborted; a delta for a sequence whose request is gone is dropped.
See docs/ARCHITECTURE.md, "The three services".
"""
from __future__ import annotations

from itertools import repeat

from pagedserve.gateway import request_intake
from pagedserve.gateway.beam_search import BeamDone
from pagedserve.gateway.request_intake import RequestState
from pagedserve.gateway.scheduler import Scheduler
from pagedserve.gateway.sequence import Sequence
from pagedserve.gateway.step_updates import StepUpdates
from pagedserve.wire.protocol import Delta, ModelInfo, SamplingParams

_NONE: list = []  # the empty lists of deltas (consumers read them, never change them)
_PLAIN = (False, _NONE, _NONE, _NONE)  # a plain token's finished, logprobs, top logprobs, prompt logprobs


class Requests:
    def __init__(self, scheduler: Scheduler, info: ModelInfo, tokenizer=None):
        self.scheduler = scheduler
        self.info = info
        self.tokenizer = tokenizer
        self.by_id: dict[str, RequestState] = {}

    def add(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
            *, priority: int = 0, final_len: int | None = None, salt: str | None = None,
            arrival: float | None = None) -> None:
        """Check and queue a request (pagedserve.gateway.request_intake); RequestError naming the bad field."""
        request_intake.add(self, request_id, prompt_token_ids, sampling, priority=priority, final_len=final_len,
                           salt=salt, arrival=arrival)

    def abort(self, request_id: str) -> None:
        if self.by_id.pop(request_id, None) is not None:
            self.scheduler.abort_request(request_id)

    def deltas(self, updates: StepUpdates) -> list[Delta]:
        """Each row's delta, in row order (none for a request that is gone, or after its
        stop string)."""
        deltas: list[Delta] = []
        by_id, more = self.by_id, updates.more
        rows = map(more.get, range(len(updates))) if more else repeat(None)
        for seq, token, update in zip(updates.seqs, updates.tokens, rows):
            if update is None:  # a plain token
                finished, logprobs, top, first = _PLAIN
            elif update.__class__ is BeamDone:
                deltas.extend(self._beam_done(update))
                continue
            else:
                finished, logprob, top = update.finished, update.logprob, update.top_logprobs
                logprobs, top, first = (_NONE if logprob is None else [logprob], [top] if top else _NONE,
                                        update.prompt_logprobs or _NONE)
            state = by_id.get(seq.request_id)
            if state is None:
                continue
            if update is not None and update.error is not None:  # it failed alone: its request ends
                deltas.append(self._refused(seq, update.error))
                continue
            try:
                stream = state.streams[seq.index]
                if stream.stopped:  # overlap: a token computed before the stop string was seen
                    continue
                text = stream.add(token)
                finish = seq.finish_reason if finished else None
                if stream.stopped and not finished:
                    self.scheduler.abort(seq.seq_id, "stop")
                    finish = "stop"
                if finish:
                    text += stream.flush()
                    self._close(state, seq.index)
            except Exception as e:  # noqa: BLE001 - detokenizing or stop rules of one request
                delta = self._refused(seq, f"the gateway could not make this sequence's output: "
                                           f"{type(e).__name__}: {e}")
                if delta is not None:
                    deltas.append(delta)
                continue
            cached = seq.num_cached_tokens
            deltas.append(Delta(seq.request_id, seq.index, text, [token], finish, logprobs, top, first,
                                state.prompt_len, len(seq.output_token_ids), cached if cached > 0 else 0))
        return deltas

    def _refused(self, seq: Sequence, error: str) -> Delta | None:
        """`seq` failed alone: its request ends with an error delta."""
        state = self.by_id.get(seq.request_id)
        if state is None:
            return None
        self.abort(seq.request_id)
        return Delta(seq.request_id, seq.index, "", [], "refused", prompt_tokens=state.prompt_len,
                     error=error)

    def _beam_done(self, done: BeamDone) -> list[Delta]:
        state = self.by_id.pop(done.request_id, None)
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

    def rejected(self, seq: Sequence) -> Delta | None:
        """memsvc will never fit `seq`: its request ends with an error delta."""
        state = self.by_id.get(seq.request_id)
        if state is None:
            return None
        self.abort(seq.request_id)
        return Delta(seq.request_id, seq.index, "", [], "error", prompt_tokens=state.prompt_len,
                     error=seq.error)

    def _close(self, state: RequestState, index: int) -> None:
        state.open.discard(index)
        if not state.open:
            self.by_id.pop(state.request_id, None)
