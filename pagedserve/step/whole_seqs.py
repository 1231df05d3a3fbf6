"""A step of sequences given whole (their tables and token histories), through a running set
of their own: for callers outside the serving path (benchmarks, model checks, tests) that
run a model on a few sequences without the step message."""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.step.running_set import RunningSet
from pagedserve.step.step_batch import StepBatch
from pagedserve.wire.protocol import SamplingParams


@dataclass
class Seq:
    """Compute `tokens` at positions start.. with the context in `table`; `prompt` and
    `output`: the sequence's tokens so far, for penalties, grammars and prompt logprobs."""

    seq_id: str
    tokens: list[int]
    start: int
    table: list[int]
    sample: bool = True
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.0))
    seed: int = 0
    prompt: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)


def batch_of(seqs: list[Seq], block_size: int, **batch_fields) -> StepBatch:
    """The StepBatch of `seqs` (ValueError as the running set raises it, and for a sequence
    given twice or whose prompt and output do not reach its start)."""
    running = RunningSet(block_size)
    for s in seqs:
        if s.seq_id in running.row_of:
            raise ValueError(f"sequence {s.seq_id}: given twice in one step (one row each)")
        history = (list(s.prompt) + list(s.output))[:s.start]
        if (s.prompt or s.output) and len(history) < s.start:
            raise ValueError(f"sequence {s.seq_id}: its prompt and output hold {len(history)} tokens, "
                             f"fewer than the {s.start} before its step")
        running.admit(s.seq_id, s.sampling, s.seed, len(s.prompt), history, s.prompt, s.table)
    return running.apply([s.seq_id for s in seqs], [s.start for s in seqs], [len(s.tokens) for s in seqs],
                         [t for s in seqs for t in s.tokens], None, [s.sample for s in seqs],
                         [len(s.table) for s in seqs], [0] * len(seqs), [], **batch_fields).batch
