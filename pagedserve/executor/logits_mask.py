"""Structured output on the executor: the grammar's token mask, applied to the logits before
sampling (xgrammar; see BENCHMARKS.md for why this engine).

Contract:
- `GuidedDecoding(tokenizer_dir, vocab_size, stop_token_ids)`; `prepare(batch, rows)`
  starts computing the masks of the sampled rows whose SamplingParams carry a grammar
  (`guided_kind`), on a worker thread, so that it overlaps the forward pass; `apply(logits,
  pending)` waits for them and sets every token the grammar does not allow to -inf in place
  (logits row k is batch row rows[k]; rows without a grammar untouched). Call both from one
  thread.
- A sequence's grammar state is a function of its output tokens only (StepBatch.output_of:
  the running set keeps the token history, as SamplingParams.uses_penalties is true with a
  grammar).
  Matchers are cached per sequence id and advanced by the new tokens; when the cached
  matcher's tokens are not a prefix of the outputs (preemption with recompute, a fork's
  first step, a beam that took a sibling's continuation, another gateway reusing an id) it
  is rebuilt by replaying the outputs. So the state survives preemption, recompute, swap,
  forks (n > 1, beam search) and executor restarts.
- Once the grammar is complete only the stop tokens (EOS) are allowed. A token the grammar
  refused (impossible through this mask, unless the request changed its grammar) leaves the
  sequence unconstrained rather than failing the step.
- Grammars compile off the step: `expect(batch)` (the model runner calls it with every
  step, the executor service as soon as a step arrives) starts compiling each
  grammar not compiled yet on a compile thread (pagedserve.executor.grammar_cache), so that it
  compiles while the sequence's prompt does; only the mask of a sequence whose grammar is
  still compiling waits for it, on the mask thread. Compiled grammars are kept within
  `cache_bytes` (--grammar-cache-bytes).
- Closing within max_tokens: once a sequence has `close_window(max_tokens, depth)` tokens
  or fewer left (a quarter of max_tokens up to CLOSE_WITHIN, and at least the output's open
  strings, arrays and objects plus CLOSE_MARGIN), its mask keeps only the closing tokens
  (made of `"`, `]`, `}` alone, or a stop token; inside a string, those that begin with `"`)
  wherever the grammar allows one, so that an output that is still open ends as soon as the
  grammar lets it (a string, array or object closes instead of growing). Only allowed tokens
  are kept: the output follows the grammar all the same.

The model runner applies them (ModelRunner.execute: `prepare` before the forward pass,
`apply` to the sampled rows' logits before the sampler); the Executor gives its runner one
GuidedDecoding. `GuidedSampler` wraps any sampler with the same masks, not overlapped.
"""
from __future__ import annotations

import collections
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from pagedserve.executor.grammar_cache import GRAMMAR_CACHE_BYTES, GrammarCache, choice_grammar, compile_grammar  # noqa: F401
import numpy as np

from pagedserve.step.step_batch import FLAG_GUIDED, StepBatch

MAX_MATCHERS = 4096
CLOSE_WITHIN = 64  # tokens left to max_tokens from which a guided output is steered to close
CLOSE_MARGIN = 8  # ... or the open nesting depth plus these
CLOSING_CHARS = frozenset('"]}')


def close_window(max_tokens: int, depth: int = 0) -> int:
    return max(min(CLOSE_WITHIN, max_tokens // 4), depth + CLOSE_MARGIN if depth else 0)


def closing_bitmask(pieces: list[str], vocab_size: int, stop_token_ids,
                    in_string: bool = False) -> torch.Tensor:
    """xgrammar's bitmask row (int32 words) of the tokens made of CLOSING_CHARS alone (in a
    string: and beginning with its closing quote), and the stop tokens; `pieces` are the
    tokens' vocabulary strings (the tokenizer's convert_ids_to_tokens: JSON's punctuation is
    itself in them)."""
    import xgrammar as xgr

    allowed = torch.zeros(vocab_size, dtype=torch.bool)
    for i, piece in enumerate(pieces[:vocab_size]):
        if piece and set(piece) <= CLOSING_CHARS and (piece[0] == '"' or not in_string):
            allowed[i] = True
    for t in stop_token_ids:
        if 0 <= t < vocab_size:
            allowed[t] = True
    row = xgr.allocate_token_bitmask(1, vocab_size)[0]
    for word in range(row.numel()):
        bits = allowed[word * 32:(word + 1) * 32].tolist()
        row[word] = int.from_bytes(sum(1 << b for b, on in enumerate(bits) if on).to_bytes(4, "little"),
                                   "little", signed=True)
    return row


class _Matcher:
    __slots__ = ("matcher", "tokens", "broken", "depth", "in_string", "escaped")

    def __init__(self, matcher):
        self.matcher = matcher
        self.tokens: list[int] = []
        self.broken = False
        self.depth = 0  # open JSON strings, arrays and objects in the output so far
        self.in_string = self.escaped = False

    def scan(self, piece: str) -> None:
        for ch in piece:
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string, self.depth = False, self.depth - 1
            elif ch == '"':
                self.in_string, self.depth = True, self.depth + 1
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth = max(0, self.depth - 1)


class GuidedDecoding:
    def __init__(self, tokenizer_dir: str, vocab_size: int, stop_token_ids: list[int] | None = None,
                 tokenizer=None, cache_bytes: int = GRAMMAR_CACHE_BYTES):
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids or [])
        self._tokenizer = tokenizer
        self._compiler = None
        self._compiler_lock = threading.Lock()
        self.grammars = GrammarCache(self.compiler, cache_bytes)
        self._matchers: collections.OrderedDict[str, _Matcher] = collections.OrderedDict()
        self._closing = None  # bitmask rows of the closing tokens (out of, in a string), built
        # with the compiler
        self._pieces: list[str] = []  # token id -> vocabulary string, likewise
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pagedserve-grammar")
        self._lock = threading.Lock()

    # -- compiling -----------------------------------------------------------------------------
    def compiler(self):
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr

                tokenizer = self._tokenizer
                if tokenizer is None:
                    from transformers import AutoTokenizer

                    tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_dir)
                info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids or None)
                self._pieces = [p or "" for p in tokenizer.convert_ids_to_tokens(
                    list(range(min(len(tokenizer), self.vocab_size))))]
                self._closing = [closing_bitmask(self._pieces, self.vocab_size, self.stop_token_ids, in_string)
                                 for in_string in (False, True)]
                self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)  # cached here, bounded
            return self._compiler

    def expect(self, batch: StepBatch) -> None:
        """Start compiling the grammars of the batch's sequences that are neither compiled nor
        compiling."""
        for i in np.flatnonzero(batch.flags & FLAG_GUIDED):
            sp = batch.held[i].sampling
            self.grammars.start(sp.guided_kind, sp.guided_spec)

    def grammar(self, kind: str, spec: str):
        """The compiled grammar of (kind, spec), waiting for its compile; ValueError if invalid."""
        return self.grammars.compiled(kind, spec).result()

    # -- per sequence ------------------------------------------------------------------------------
    def _matcher(self, seq_id: str, sp, outputs: list[int]) -> _Matcher:
        import xgrammar as xgr

        key = f"{seq_id}\0{sp.guided_kind}\0{hash(sp.guided_spec)}"
        m = self._matchers.get(key)
        if m is not None:
            n = len(m.tokens)
            if n > len(outputs) or m.tokens != outputs[:n]:
                m = None  # another history (recompute, fork, beam): replay
        if m is None:
            m = _Matcher(xgr.GrammarMatcher(self.grammar(sp.guided_kind, sp.guided_spec)))
            self._matchers[key] = m
            while len(self._matchers) > MAX_MATCHERS:
                self._matchers.popitem(last=False)
        else:
            self._matchers.move_to_end(key)
        for t in outputs[len(m.tokens):]:
            if not m.broken and not m.matcher.is_terminated() and not m.matcher.accept_token(t):
                m.broken = True
            m.tokens.append(t)
            if t < len(self._pieces):
                m.scan(self._pieces[t])
        return m

    def _masks(self, batch: StepBatch, rows: np.ndarray):
        """Masks for the batch's `rows` (mask row k for batch row rows[k])."""
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        masked, failed = [], {}
        for i in np.flatnonzero(batch.flags[rows] & FLAG_GUIDED).tolist():
            row = int(rows[i])
            sp, outputs = batch.held[row].sampling, batch.output_of(row)
            try:
                m = self._matcher(batch.seq_ids[row], sp, outputs)
            except ValueError as e:  # its grammar does not compile here: that sequence fails alone
                failed[i] = str(e)
                continue
            if m.broken or m.matcher.is_terminated():  # finishing: the stop token is in
                continue
            m.matcher.fill_next_token_bitmask(bitmask, i)
            left = sp.max_tokens - len(outputs)
            if left <= close_window(sp.max_tokens, m.depth) and not m.escaped:
                closing = bitmask[i] & self._closing[m.in_string]
                if bool(closing.any()):
                    bitmask[i] = closing
            masked.append(i)
        return bitmask, masked, failed

    def prepare(self, batch: StepBatch, rows: np.ndarray) -> Future | None:
        """Start computing the masks of the batch's `rows` (the sampled ones, in order; mask
        row k for rows[k]); None if none is guided."""
        if not (batch.flags[rows] & FLAG_GUIDED).any():
            return None
        self.expect(batch)
        return self._pool.submit(self._guarded_masks, batch, rows)

    def _guarded_masks(self, batch, rows):
        with self._lock:
            return self._masks(batch, rows)

    def apply(self, logits: torch.Tensor, pending: Future | None) -> dict[int, str]:
        """Disallowed tokens of the guided rows of `logits` [S, vocab] to -inf, in place;
        returns {row: why} for the rows whose grammar could not be had (their samples are
        void: the sequences fail alone)."""
        if pending is None:
            return {}
        import xgrammar as xgr

        bitmask, rows, failed = pending.result()
        if rows:
            xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
        return failed

    def forget(self, seq_ids) -> None:
        """Drop the matchers of sequences that finished or were preempted (a preempted one
        that comes back replays its tokens into a new matcher)."""
        gone = set(seq_ids)
        for key in [k for k in self._matchers if k.split("\0", 1)[0] in gone]:
            self._matchers.pop(key, None)


class GuidedSampler:
    """A sampler that applies the grammar masks first: the hook without the overlap with the
    forward pass, for wherever the model runner's own hook is not in place
    (`runner.sampler = GuidedSampler(runner.sampler, guided)`)."""

    def __init__(self, inner, guided: GuidedDecoding):
        self.inner = inner
        self.guided = guided
        self.mask_seconds = 0.0  # spent computing and applying masks (steps with a grammar)
        self.mask_steps = 0

    def sample(self, logits: torch.Tensor, batch: StepBatch, rows: np.ndarray, **kw):
        """The inner sampler's `sample` (pagedserve.executor.sampler.Sampler.sample), masks first."""
        import time

        start = time.perf_counter()
        pending = self.guided.prepare(batch, rows)
        if pending is not None:
            self.guided.apply(logits, pending)
            self.mask_seconds += time.perf_counter() - start
            self.mask_steps += 1
            kw.pop("greedy", None)  # the masks may move the argmax
        return self.inner.sample(logits, batch, rows, **kw)
