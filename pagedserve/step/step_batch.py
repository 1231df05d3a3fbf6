"""One step as the model runner takes it: columns over its B sequences and T tokens.

A StepBatch is made by the running set (pagedserve.executor.running_set) from the step
message; nothing in it is built per sequence. Sequence i computes tokens
`token_ids[starts[i]:starts[i + 1]]` at positions `start_pos[i]`.., writes their K/V to the
same stretch of `slot_mapping`, reads its context through row i of `block_tables` (its first
`table_lens[i]` entries; 0 past them) and samples if `sample[i]`. `held[i]` is the
sequence's constant state (sampling parameters, seed; its token history where penalties, a
grammar or min_tokens need it); `flags` sum up what its sampling asks (the FLAG_* bits), so
the runner finds the rare rows without a loop. See docs/ARCHITECTURE.md, "One step".
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

FLAG_PLAIN = 1  # greedy, and nothing could change the argmax or ask for the distribution
FLAG_HISTORY = 2  # penalties, a grammar or min_tokens: `history` holds its tokens
FLAG_PROMPT_LOGPROBS = 4
FLAG_GUIDED = 8
FLAG_INVALID = 16  # its sampling parameters are not valid: `Held.error` says why; it never runs


class Held:
    """One sequence's constant state, and its token history when FLAG_HISTORY: its prompt
    and output tokens up to the positions stepped so far (PENDING where a fed token is not
    known yet)."""

    __slots__ = ("seq_id", "sampling", "seed", "prompt_len", "history", "prompt", "flags", "error")

    def __init__(self, seq_id: str, sampling, seed: int, prompt_len: int, history: list[int] | None,
                 prompt: list[int] | None, flags: int, error: str = ""):
        self.seq_id, self.sampling, self.seed = seq_id, sampling, seed
        self.prompt_len, self.history, self.prompt, self.flags = prompt_len, history, prompt, flags
        self.error = error


@dataclass
class StepBatch:
    seq_ids: list[str]
    start_pos: np.ndarray  # int64 [B]
    num_tokens: np.ndarray  # int64 [B]
    token_ids: np.ndarray  # int64 [T]
    sample: np.ndarray  # bool [B]
    slot_mapping: np.ndarray  # int64 [T]
    block_tables: np.ndarray  # int32 [B, W]
    table_lens: np.ndarray  # int32 [B]
    held: list[Held]
    flags: np.ndarray  # uint8 [B]
    # the sampling parameters the sampler reads for every row, as columns (greedy rows: 1.0)
    temperature: np.ndarray | None = None  # float32 [B]
    top_k: np.ndarray | None = None  # int64 [B]
    top_p: np.ndarray | None = None  # float32 [B]
    min_p: np.ndarray | None = None  # float32 [B]
    # the prompt and output tokens of each FLAG_HISTORY row as of this step (row -> lists)
    histories: dict[int, tuple[list[int], list[int]]] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)  # row -> why it is left out of the pass
    pool_epoch: str = ""
    forget: list[str] = field(default_factory=list)
    step: int = 0
    copies: list[tuple[int, int]] = field(default_factory=list)
    # fed tokens the device holds and the host not yet: (the last pass's sampled-token tensor,
    # int64 packed positions, int64 entries of that tensor) (pagedserve.step.running_feed)
    device_feed: tuple | None = None
    _starts: np.ndarray | None = field(default=None, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)

    @property
    def starts(self) -> np.ndarray:
        """int64 [B + 1]: where each sequence's tokens start in the packed columns."""
        if self._starts is None:
            s = np.zeros(len(self.seq_ids) + 1, dtype=np.int64)
            np.cumsum(self.num_tokens, out=s[1:])
            self._starts = s
        return self._starts

    @property
    def some_flags(self) -> int:
        """The FLAG_* bits of any row (every row's flags or'ed): what no row asks is skipped."""
        some = self.__dict__.get("_some")  # (not a field: made once, when first asked)
        if some is None:
            some = self._some = int(np.bitwise_or.reduce(self.flags)) if len(self.flags) else 0
        return some

    def tokens_of(self, i: int) -> np.ndarray:
        s = self.starts
        return self.token_ids[s[i]:s[i + 1]]

    def sampling(self, i: int):
        return self.held[i].sampling

    def prompt_of(self, i: int) -> list[int]:
        """The whole prompt when prompt logprobs need it, else the prompt as of this step
        (FLAG_HISTORY rows), else []."""
        h = self.held[i]
        if h.prompt is not None:
            return h.prompt
        return self.histories[i][0] if i in self.histories else []

    def output_of(self, i: int) -> list[int]:
        """The output tokens up to and including this step's (FLAG_HISTORY rows; else [])."""
        return self.histories[i][1] if i in self.histories else []

    def prompt_logprob_positions(self, i: int) -> range:
        """Positions of row i whose next token is a prompt token to score: p scores p + 1."""
        if not self.flags[i] & FLAG_PROMPT_LOGPROBS:
            return range(0)
        start = int(self.start_pos[i])
        return range(start, min(start + int(self.num_tokens[i]), len(self.held[i].prompt) - 1))

    def reports(self) -> np.ndarray:
        """bool [B]: the rows the executor returns an output for (pagedserve.wire.step_outputs) (they sample, score
        prompt tokens, or were left out)."""
        out = self.sample.copy()
        for i in self.errors:
            out[i] = True
        if self.some_flags & FLAG_PROMPT_LOGPROBS:
            for i in np.flatnonzero(self.flags & FLAG_PROMPT_LOGPROBS):
                out[i] |= bool(self.prompt_logprob_positions(int(i)))
        return out

    def columns(self) -> tuple:
        return self.temperature, self.top_k, self.top_p, self.min_p

    def select(self, rows: np.ndarray) -> StepBatch:
        """The batch of `rows` (pagedserve.step.batch_parts.select)."""
        from pagedserve.step.batch_parts import select  # it imports this module

        return select(self, rows)


def empty_batch(**kw) -> StepBatch:
    """A step with no sequences (forgets or copies only)."""
    z, f = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
    return StepBatch([], z, z, z, np.zeros(0, dtype=bool), z, np.zeros((0, 0), dtype=np.int32),
                     np.zeros(0, dtype=np.int32), [], np.zeros(0, dtype=np.uint8), f, z, f, f, **kw)
