"""What whoever runs the model holds per running sequence, and how one step's change to it
becomes the SeqStep the model runner takes: the one place a block-table change is applied
and slots are derived (the executor service, pagedserve.executor.sequence_state; an in-process
executor, pagedserve.wire.step_feed.OrderedExecutor).

A sequence's constant state (sampling parameters, seed, prompt length; its token history
when penalties or a grammar need it; the whole prompt when prompt logprobs do) comes once;
each step then brings the tokens to compute at `start_pos` and the change to its block
table: from `table_start` on, the table is `new_blocks`. See docs/ARCHITECTURE.md, "The
step path".
"""
from __future__ import annotations

from pagedserve.wire.protocol import SamplingParams, SeqStep


class HeldSeq:
    __slots__ = ("sampling", "seed", "prompt_len", "table", "tokens", "prompt")

    def __init__(self, sampling: SamplingParams, seed: int, prompt_len: int,
                 history: list[int] | None, prompt: list[int] | None = None,
                 table: list[int] | None = None):
        self.sampling = sampling
        self.seed = seed
        self.prompt_len = prompt_len
        self.table: list[int] = table if table is not None else []
        self.tokens = history  # None unless penalties need the token history
        self.prompt = prompt  # None unless prompt logprobs need the whole prompt


def held_from(sampling: SamplingParams, seed: int, prompt: list[int], output: list[int],
              start_pos: int, table: list[int] | None = None) -> HeldSeq:
    """A sequence's state from its prompt and output so far, as of a step at `start_pos`."""
    history = (prompt + output)[:start_pos] if sampling.uses_penalties else None
    return HeldSeq(sampling, seed, len(prompt) if history is not None else 0, history,
                   list(prompt) if sampling.prompt_logprobs is not None else None, table)


def apply_table_change(table: list[int], table_start: int, new_blocks: list[int], seq_id: str) -> None:
    """From `table_start` on, the table is `new_blocks`; ValueError if it starts past the end."""
    if table_start > len(table):
        raise ValueError(f"sequence {seq_id}: block table change at {table_start}, "
                         f"but it holds {len(table)} blocks")
    del table[table_start:]
    table.extend(new_blocks)


def slots_of(table: list[int], start: int, n: int, block_size: int, seq_id: str = "") -> list[int]:
    """The pool slots of positions start .. start + n - 1; ValueError if the table is short."""
    try:
        if n == 1:  # a decode step
            return [table[start // block_size] * block_size + start % block_size]
        return [table[p // block_size] * block_size + p % block_size for p in range(start, start + n)]
    except IndexError:
        raise ValueError(f"sequence {seq_id}: {len(table)} blocks in its table, "
                         f"{-(-(start + n) // block_size)} needed for {start + n} tokens") from None


def step_of(held: HeldSeq, seq_id: str, tokens: list[int], start: int, sample: bool,
            table_start: int, new_blocks: list[int], block_size: int) -> SeqStep:
    """Apply one step's change to `held` and return the step to run. `tokens` may be
    [PENDING] (pagedserve.wire.step_feed): the caller fills it just before the step runs, and its place
    in `held.tokens` (the history, when kept) too."""
    table = held.table
    if new_blocks or table_start != len(table):
        apply_table_change(table, table_start, new_blocks, seq_id)
    slots = slots_of(table, start, len(tokens), block_size, seq_id)
    history = held.tokens
    if history is not None:
        del history[start:]
        history.extend(tokens)
        pl = held.prompt_len
        prompt, output = history[:pl], history[pl:]
    else:
        prompt, output = [], []
    if held.prompt is not None:
        prompt = held.prompt
    # a copy of the table: the next step's change may come while this one runs
    return SeqStep(seq_id, tokens, start, slots, table[:], sample, held.sampling, held.seed,
                   prompt, output)
