"""An in-process executor run as the executor service runs one: it takes the step message
(pagedserve.wire.step_delta.StepDelta), holds each sequence's state (pagedserve.wire.held_seqs) and turns each
step into the StepBatch the executor runs, runs one caller's steps in their order
(pagedserve.wire.step_feed.StepOrder), and fills fed tokens from its own last samples
(pagedserve.wire.step_feed.LastSampled). The batching loop wraps every executor that does not feed
itself in one, so in-process steps take the path steps across the wire take.
See docs/ARCHITECTURE.md, "The step path".
"""
from __future__ import annotations

import threading

from pagedserve.wire.held_seqs import HeldSeq, held_from, step_of
from pagedserve.wire.pending_token import PENDING
from pagedserve.wire.protocol import SampleOutput, StepBatch
from pagedserve.wire.step_delta import StepDelta
from pagedserve.wire.step_feed import LastSampled, StepOrder


class OrderedExecutor:
    def __init__(self, inner, tables=None):
        self.inner = inner
        self.tables = tables  # memsvc's MemoryClient.tables, for one that lost its state
        self.block_size = inner.model_info().kv.block_size
        self.feed = LastSampled()
        self.order = StepOrder()
        self.held: dict[str, HeldSeq] = {}
        self._lock = threading.Lock()

    def model_info(self):
        return self.inner.model_info()

    def execute(self, step: StepDelta) -> list[SampleOutput]:
        self.order.wait_turn(step.step)
        with self._lock:
            try:
                batch, histories = self._expand(step)
                self.feed.fill(batch)
                for s, history in histories:
                    history[s.start_pos] = s.token_ids[0]
                outputs = self.inner.execute(batch)
                self.feed.record(batch, outputs)
                return outputs
            finally:
                self.order.passed(step.step)

    def _expand(self, step: StepDelta) -> tuple[StepBatch, list]:
        held, bs = self.held, self.block_size
        for seq_id in step.forget:
            held.pop(seq_id, None)
        seqs, histories = [], []
        tokens, blocks = step.token_ids, step.new_blocks
        at = bat = 0
        for i, seq_id in enumerate(step.seq_ids):
            n, k = step.num_tokens[i], step.num_new_blocks[i]
            h = held.get(seq_id)
            if h is None:  # new to it: the state from the gateway's sequence
                seq = step.seqs[i]
                if seq is None:
                    raise ValueError(f"sequence {seq_id}: unknown, and the step does not carry its state")
                table = None
                if step.table_start[i]:  # it lost the state: the whole table is memsvc's
                    if self.tables is None:
                        raise ValueError(f"sequence {seq_id}: unknown, and the step holds only a change to "
                                         "its table (no `tables` to ask memsvc for the whole one)")
                    table = self.tables([seq_id])[0]
                h = held[seq_id] = held_from(seq.sampling, seq.seed, seq.prompt_token_ids,
                                             seq.output_token_ids, step.start_pos[i], table)
            own = tokens[at:at + n]  # filled in place: the gateway's stays PENDING
            s = step_of(h, seq_id, own, step.start_pos[i], step.sample[i], step.table_start[i],
                        blocks[bat:bat + k], bs)
            if own[0] == PENDING and h.tokens is not None:
                histories.append((s, h.tokens))
            seqs.append(s)
            at += n
            bat += k
        return StepBatch(seqs, step.pool_epoch, list(step.forget), step.step), histories
