"""A zero-cost stand-in for the model, for measuring the control plane alone.

`pagedserve executor --zero-cost` serves it: it registers a minimal KV geometry with memsvc
(1 layer, 1 head of size 1), maps the pool, and answers every Execute with one fixed token
per sequence that samples (prompt logprobs: all 0), touching neither the pool nor the tokens.
Everything else on the
executor's side of a step (the wire, the per-sequence state, the step merger) runs as with
a real model, so `pagedserve bench control-plane` measures what the services cost per step
when the forward pass costs nothing. Its ModelInfo names the default model's tokenizer, so
the gateway detokenizes real text.
"""
from __future__ import annotations

import itertools

import numpy as np

from pagedserve.step.step_batch import FLAG_PROMPT_LOGPROBS, StepBatch
from pagedserve.wire.protocol import KVGeometry, ModelInfo, PromptLogprob, SampleOutput
from pagedserve.wire.step_outputs import StepOutputs

FIXED_TOKEN = 260  # " the" in the default model's tokenizer
VOCAB = 49152  # the default model's vocabulary


class ZeroCostExecutor:
    def __init__(self, block_size: int = 16, max_model_len: int = 8192, tokenizer_dir: str = "",
                 token_id: int = FIXED_TOKEN):
        self.token_id = token_id
        self.device = "cpu"
        self.info = ModelInfo("zero-cost", max_model_len, VOCAB, [], None, tokenizer_dir,
                              KVGeometry(1, 1, 1, block_size))
        self.num_steps = 0

    def model_info(self) -> ModelInfo:
        return self.info

    def attach_pool(self, pool) -> None:
        pass

    def execute(self, batch: StepBatch) -> StepOutputs:
        self.num_steps += 1
        token, ids, sample = self.token_id, batch.seq_ids, batch.sample
        if batch.errors or batch.some_flags & FLAG_PROMPT_LOGPROBS:
            return StepOutputs.of(_output(batch, i, token) for i in np.flatnonzero(batch.reports()).tolist())
        ids = list(itertools.compress(ids, sample.tolist()))
        return StepOutputs(ids, [token] * len(ids))


def _output(batch: StepBatch, i: int, token: int) -> SampleOutput:
    """Row i's output: left out, sampled, or a prompt chunk with prompt logprobs (every
    prompt token certain)."""
    if i in batch.errors:
        return SampleOutput(batch.seq_ids[i], -1, sampled=False, error=batch.errors[i])
    if batch.sample[i]:
        return SampleOutput(batch.seq_ids[i], token)
    positions = batch.prompt_logprob_positions(i)
    ids = batch.prompt_of(i)[positions.start + 1:positions.stop + 1]
    return SampleOutput(batch.seq_ids[i], -1, sampled=False, prompt_logprobs=[PromptLogprob(t, 0.0, 1) for t in ids])
