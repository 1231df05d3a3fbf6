"""An executor without a model, for testing the memory and scheduling paths exactly.

It stores each token id in its KV slot and "samples" a hash of the whole context read
back through the block table, so any wrong slot, block table, copy or prefix hit changes
the output. `reference_next` computes the same from the plain token list. `SlowExecutor`
pauses each step, so a test can cancel or kill something mid-generation.
"""
from __future__ import annotations

import hashlib
import time

import torch

from pagedserve.step.step_batch import StepBatch
from pagedserve.wire.protocol import KVGeometry, ModelInfo
from pagedserve.wire.step_outputs import StepOutputs

VOCAB = 1000
EOS = 999


def reference_next(context: list[int], seed: int = 0) -> int:
    digest = hashlib.blake2b(repr((context, seed)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (VOCAB - 1)  # never EOS, so lengths are exact


class FakeExecutor:
    def __init__(self, block_size: int, max_model_len: int = 4096):
        self.info = ModelInfo("fake", max_model_len, VOCAB, [EOS], None, "",
                              KVGeometry(1, 1, 1, block_size))
        self.pool: torch.Tensor | None = None
        self.num_executed_tokens = 0

    def attach_pool(self, pool: torch.Tensor) -> None:
        self.pool = pool

    def model_info(self) -> ModelInfo:
        return self.info

    def execute(self, batch: StepBatch) -> StepOutputs:
        bs = self.info.kv.block_size
        for tok, slot in zip(batch.token_ids.tolist(), batch.slot_mapping.tolist()):
            self.pool[slot // bs, 0, 0, slot % bs, 0, 0] = float(tok)
        self.num_executed_tokens += len(batch.token_ids)
        ids, tokens = [], []
        pool_k = self.pool[:, 0, 0, :, 0, 0]
        for i in batch.sample.nonzero()[0].tolist():
            n = int(batch.start_pos[i] + batch.num_tokens[i])
            table = batch.block_tables[i]
            context = [int(pool_k[table[p // bs], p % bs]) for p in range(n)]
            ids.append(batch.seq_ids[i])
            tokens.append(reference_next(context, batch.held[i].seed))
        return StepOutputs(ids, tokens)


class SlowExecutor(FakeExecutor):
    """The fake executor with a pause of `delay` seconds before each step."""

    def __init__(self, *args, delay: float = 0.0, **kw):
        super().__init__(*args, **kw)
        self.delay = delay

    def execute(self, batch: StepBatch) -> StepOutputs:
        time.sleep(self.delay)
        return super().execute(batch)
