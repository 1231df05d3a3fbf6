"""Prompt logprobs: the model's log-probability of each prompt token given the tokens before it.

A sequence whose sampling asks for prompt_logprobs scores its prompt_logprob_positions: the
LM head runs on the hidden state of each such position (other sequences keep the
last-position-only path), and position p gives prompt token p + 1 its logprob under the
raw model distribution (log-softmax of the logits; no penalty, temperature or truncation),
its rank (1 + the number of more likely tokens) and the top k (k = prompt_logprobs). The
next token of a chunk's last position is the next chunk's first one, read from the whole
prompt the running set holds for it (StepBatch.prompt_of). Rows go through the LM head in slices of
ROWS, so a long prefill chunk never holds all its logits at once.
"""
from __future__ import annotations

import torch

import numpy as np

from pagedserve.step.step_batch import FLAG_PROMPT_LOGPROBS, StepBatch
from pagedserve.wire.protocol import PromptLogprob, SampleOutput
from pagedserve.wire.step_outputs import StepOutputs

ROWS = 256


class PromptScoring:
    """The rows of a step to score: `of(batch, vocab_size)` (None when no sequence asks;
    ValueError for a prompt token outside the vocabulary), then `run(model, hidden)`."""

    def __init__(self):
        self.rows: list[int] = []  # indices into the step's packed tokens
        self.targets: list[int] = []  # the prompt token each row scores
        self.seqs: list[tuple[int, int, int]] = []  # (batch index, number of rows, k)

    @classmethod
    def of(cls, batch: StepBatch, vocab_size: int | None = None) -> "PromptScoring | None":
        scoring = None
        for i in np.flatnonzero(batch.flags & FLAG_PROMPT_LOGPROBS).tolist():
            positions = batch.prompt_logprob_positions(i)
            if positions:
                scoring = scoring or cls()
                targets = batch.prompt_of(i)[positions.start + 1:positions.stop + 1]
                if vocab_size is not None and not 0 <= min(targets) <= max(targets) < vocab_size:
                    raise ValueError(f"sequence {batch.seq_ids[i]}: prompt token ids must be in [0, {vocab_size})")
                first = int(batch.starts[i]) + positions.start - int(batch.start_pos[i])
                scoring.rows.extend(range(first, first + len(positions)))
                scoring.targets.extend(targets)
                scoring.seqs.append((i, len(positions), batch.held[i].sampling.prompt_logprobs))
        return scoring

    def run(self, model, hidden: torch.Tensor) -> dict[int, list[PromptLogprob]]:
        """Batch index -> its entries, for prompt positions start_pos + 1 on."""
        dev = hidden.device
        rows = torch.tensor(self.rows, dtype=torch.int64, device=dev)
        targets = torch.tensor(self.targets, dtype=torch.int64, device=dev)
        k = max(k for _, _, k in self.seqs)
        chosen, ranks, top_values, top_ids = [], [], [], []
        for a in range(0, len(self.rows), ROWS):
            logprobs = model.compute_logits(hidden[rows[a:a + ROWS]]).log_softmax(-1)
            lp = logprobs.gather(1, targets[a:a + ROWS, None])
            chosen.append(lp[:, 0])
            ranks.append((logprobs > lp).sum(-1) + 1)
            if k:
                values, ids = logprobs.topk(k, -1)
                top_values.append(values)
                top_ids.append(ids)
        chosen = torch.cat(chosen).tolist()
        ranks = torch.cat(ranks).tolist()
        if k:
            top_values = torch.cat(top_values).tolist()
            top_ids = torch.cat(top_ids).tolist()
        out = {}
        at = 0
        for i, n, seq_k in self.seqs:
            entries = []
            for r in range(at, at + n):
                top = ([(t, v) for t, v in zip(top_ids[r][:seq_k], top_values[r][:seq_k]) if v != float("-inf")]
                       if seq_k else [])
                entries.append(PromptLogprob(self.targets[r], chosen[r], ranks[r], top))
            out[i] = entries
            at += n
        return out


def attach(batch: StepBatch, sampled: StepOutputs, scores: dict[int, list[PromptLogprob]]) -> StepOutputs:
    """One output per sequence that reports, in batch order: the sampled ones (`sampled`, one
    per sequence with sample set, in order) with their prompt logprobs, and prompt-only ones.
    Where every scored sequence samples, `sampled` itself, its entries added in place."""
    sample = batch.sample
    if all(sample[i] for i in scores):
        entry = np.cumsum(sample) - 1  # batch index -> its entry in `sampled`
        for i, entries in scores.items():
            if entries:
                k = int(entry[i])
                o = sampled[k]  # (a plain entry: made whole)
                o.prompt_logprobs = entries
                sampled.put(k, o)
        return sampled
    ids, tokens, more = [], [], {}  # a prompt-only entry goes between: the columns built anew
    k = 0
    for i, samples in enumerate(sample.tolist()):
        entries = scores.get(i)
        if samples:
            o = sampled[k] if entries else sampled.more.get(k)
            if entries:
                o.prompt_logprobs = entries
            if o is not None:
                more[len(ids)] = o
            ids.append(sampled.seq_ids[k])
            tokens.append(sampled.tokens[k])
            k += 1
        elif entries:
            more[len(ids)] = SampleOutput(batch.seq_ids[i], -1, sampled=False, prompt_logprobs=entries)
            ids.append(batch.seq_ids[i])
            tokens.append(-1)
    return StepOutputs(ids, tokens, more)
