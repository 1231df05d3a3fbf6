"""Beam search for one request, scored as Hugging Face transformers' `generate` scores it.

Each live beam is a sequence; the executor returns its top K next-token logprobs (greedy,
`logprobs=K`, K = max(2, 1 + number of EOS ids) * beam_width, at most 20). Once every live
beam has reported, `advance`:
1. ranks all candidates (beam score + token logprob; a beam's score is the sum of its
   tokens' logprobs) and keeps the best K;
2. a candidate "stops" if its token is EOS (unless ignore_eos) or a stop token id, or it
   reaches max_tokens (or the model's maximum length);
3. the best beam_width candidates that do not stop become the next live beams;
4. stopping candidates ranked among the first beam_width become finished hypotheses with
   score sum / length ** length_penalty (length counts generated tokens, the last one
   included), unless the finished set is full with early_stopping, or no improvement is
   possible; the best beam_width hypotheses are kept;
5. the search is done when no running beam can beat the worst finished hypothesis (with
   beam_width finished; the best running score over the current length, as transformers'
   heuristic for early_stopping=False), when early_stopping and beam_width hypotheses
   finished, or when every kept candidate stops.
Completions are the n best hypotheses, best first. `Beams` keeps the scheduler's searches
and maps continuations onto sequences: a parent's first continuation keeps its sequence,
further ones fork it, and parents without continuations are freed.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Protocol

from pagedserve.gateway.sequence import Sequence, SeqStatus
from pagedserve.wire.protocol import SamplingParams

MAX_CANDIDATES = 20  # the executor's limit on top logprobs


def num_candidates(beam_width: int, num_eos: int) -> int:
    return min(max(2, 1 + num_eos) * beam_width, MAX_CANDIDATES)


def beam_sampling(sp: SamplingParams, candidates: int) -> SamplingParams:
    """What each beam asks the executor for: the greedy distribution's top logprobs."""
    return dataclasses.replace(sp, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, n=1,
                               logprobs=candidates)


@dataclass
class Beam:
    seq_id: str
    token_ids: list[int]  # generated so far
    score: float  # sum of the tokens' logprobs
    logprobs: list[float] = field(default_factory=list)


@dataclass
class Hypothesis:
    token_ids: list[int]
    score: float  # length-normalized
    logprobs: list[float]
    finish_reason: str  # "stop" or "length"


@dataclass
class Continuation:
    parent_id: str
    token_id: int
    logprob: float
    score: float


class BeamSearch:
    def __init__(self, sp: SamplingParams, first_seq_id: str, *, max_new_tokens: int,
                 is_stop: Callable[[int], bool], num_eos: int = 1):
        self.width = sp.beam_width
        self.n = sp.n
        self.length_penalty = sp.length_penalty
        self.early_stopping = sp.early_stopping
        self.max_new_tokens = max_new_tokens
        self.is_stop = is_stop
        self.num_candidates = num_candidates(self.width, num_eos)
        self.beams = [Beam(first_seq_id, [], 0.0)]
        self.num_forks = 1  # beams made so far (names the next one)
        self.finished: list[Hypothesis] = []  # best first, at most width
        self.improvable = True
        self.done = False
        self._reports: dict[str, list[tuple[int, float]]] = {}
        self._next: list[Beam] = []

    def report(self, seq_id: str, top_logprobs: list[tuple[int, float]]) -> bool:
        """A live beam's candidates; True once every live beam has reported."""
        self._reports[seq_id] = top_logprobs
        return len(self._reports) == len(self.beams)

    def advance(self) -> list[Continuation]:
        """Rank the reported candidates; return the next live beams' parents and tokens."""
        length = len(self.beams[0].token_ids) + 1
        ranked = []
        for order, beam in enumerate(self.beams):
            for token, logprob in self._reports[beam.seq_id]:
                ranked.append((beam.score + logprob, order, token, logprob))
        ranked.sort(key=lambda c: (-c[0], c[1], c[2]))
        ranked = ranked[: self.num_candidates]
        stops = [self.is_stop(t) or length >= self.max_new_tokens for _, _, t, _ in ranked]
        full = self.early_stopping and len(self.finished) == self.width
        if not full and self.improvable:
            for (score, order, token, logprob), stop in zip(ranked[: self.width], stops):
                if stop:
                    beam = self.beams[order]
                    self.finished.append(Hypothesis(
                        beam.token_ids + [token], score / length ** self.length_penalty,
                        beam.logprobs + [logprob], "stop" if self.is_stop(token) else "length"))
            self.finished.sort(key=lambda h: -h.score)
            del self.finished[self.width :]
        running = [c for c, stop in zip(ranked, stops) if not stop][: self.width]
        if len(self.finished) == self.width:
            best = running[0][0] if running else float("-inf")
            self.improvable = best / length ** self.length_penalty > self.finished[-1].score
        self.done = (not self.improvable or not running
                     or (self.early_stopping and len(self.finished) == self.width))
        self._reports = {}
        out, self._next = [], []
        for score, order, token, logprob in running:
            beam = self.beams[order]
            out.append(Continuation(beam.seq_id, token, logprob, score))
            self._next.append(Beam("", beam.token_ids + [token], score, beam.logprobs + [logprob]))
        return out

    def commit(self, seq_ids: list[str]) -> None:
        """Name the sequences now holding the continuations `advance` returned, in order."""
        for beam, seq_id in zip(self._next, seq_ids, strict=True):
            beam.seq_id = seq_id
        self.beams, self._next = self._next, []

    def results(self) -> list[Hypothesis]:
        """The n best hypotheses, best first."""
        return self.finished[: self.n]


@dataclass
class BeamDone:
    """A beam search finished: its best hypotheses, best first."""

    request_id: str
    hypotheses: list[Hypothesis]
    cached_tokens: int


class BeamHost(Protocol):
    """What Beams needs of the scheduler."""

    seqs: dict[str, Sequence]  # every live sequence by id
    running: list[Sequence]
    forks: list[tuple[str, str]]  # (parent, child): memsvc forks them before the next reserve

    def enqueue(self, seq: Sequence) -> None: ...  # into the queue its status names
    def drop(self, seq: Sequence) -> None: ...  # forget it; memsvc frees its blocks
    def release(self, seq: Sequence) -> None: ...  # off the device; WAITING until enqueued


class Beams:
    """The beam searches of a scheduler (request id -> search), on its sequences."""

    def __init__(self, host: BeamHost) -> None:
        self.host = host
        self.searches: dict[str, BeamSearch] = {}

    def report(self, seq: Sequence, top_logprobs: list[tuple[int, float]]) -> list[BeamDone]:
        """A beam's candidates; once all its siblings' are in, the search advances."""
        search = self.searches[seq.request_id]
        if not search.report(seq.seq_id, top_logprobs):
            return []
        return self._advance(search, seq.request_id)

    def _advance(self, search: BeamSearch, request_id: str) -> list[BeamDone]:
        host, seqs = self.host, self.host.seqs
        parents = [seqs[b.seq_id] for b in search.beams]
        continuations = search.advance()
        if search.done:
            for seq in parents:
                host.drop(seq)
            del self.searches[request_id]
            return [BeamDone(request_id, search.results(), max(parents[0].num_cached_tokens, 0))]
        kept: dict[str, Sequence] = {}
        beams = []
        for c in continuations:
            parent = seqs[c.parent_id]
            if c.parent_id not in kept:
                beam = kept[c.parent_id] = parent
                if parent.status is SeqStatus.WAITING:  # released: recompute it
                    host.enqueue(parent)
            else:
                beam = parent.fork(f"{request_id}/b{search.num_forks}", search.num_forks)
                search.num_forks += 1
                seqs[beam.seq_id] = beam
                if parent.status is SeqStatus.WAITING:
                    beam.status, beam.num_computed = SeqStatus.WAITING, 0
                else:
                    host.forks.append((parent.seq_id, beam.seq_id))
                host.enqueue(beam)
            beams.append(beam)
        for seq in parents:
            if seq.seq_id not in kept:
                host.drop(seq)
        for beam, c in zip(beams, continuations):
            beam.output_token_ids.append(c.token_id)
        search.commit([b.seq_id for b in beams])
        return []

    def release_idle(self) -> int:
        """Free the blocks of beams that wait for their siblings (their candidates are in).

        Breaks the stall where such beams hold the blocks their preempted siblings need to
        come back; a released beam that a continuation keeps is recomputed (the prefix
        cache still holds its full blocks while nobody needs them). How many.
        """
        idle = [s for s in self.host.running
                if s.request_id in self.searches and s.num_computed == s.num_tokens]
        for seq in idle:
            self.host.release(seq)
        return len(idle)
