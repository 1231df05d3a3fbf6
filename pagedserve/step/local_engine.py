"""An executor in this process, run as the executor service runs one: it takes the step
message (pagedserve.wire.step_delta.StepDelta), applies it to its running set
(pagedserve.step.running_set), runs one caller's steps in their order
(pagedserve.wire.step_feed.StepOrder) and feeds itself from its own last samples. The
batching loop wraps every executor that does not take the step message in one, so
in-process steps take the path steps across the wire take. See docs/ARCHITECTURE.md,
"One step".
"""
from __future__ import annotations

import threading

from pagedserve.step.running_set import RunningSet
from pagedserve.wire.step_delta import StepDelta, fed_and_known, steady_decode
from pagedserve.wire.step_feed import StepOrder
from pagedserve.wire.step_outputs import StepOutputs


class LocalEngine:
    """`inner` runs StepBatches (pagedserve.executor.Executor, the test fakes); `tables`
    (memsvc's MemoryClient.tables) gives the whole table of a sequence this engine does not
    hold when the step holds only a change to it."""

    def __init__(self, inner, tables=None):
        self.inner = inner
        self.tables = tables
        self.running = RunningSet(inner.model_info().kv.block_size)
        self.order = StepOrder()
        self._lock = threading.Lock()

    def model_info(self):
        return self.inner.model_info()

    def execute(self, step: StepDelta) -> StepOutputs:
        self.order.wait_turn(step.step)
        with self._lock:
            try:
                applied = self._apply(step)
                self.running.fill(applied)
                outputs = StepOutputs.of(self.inner.execute(applied.batch))
                self.running.record(applied, outputs)
                return outputs
            finally:
                self.order.passed(step.step)

    def _apply(self, step: StepDelta):
        running = self.running
        running.forget(step.forget)
        held = running.row_of
        tstart = step.table_start
        for i in [i for i, s in enumerate(step.seq_ids) if s not in held]:
            seq_id, seq = step.seq_ids[i], step.seqs[i]
            if seq is None:
                raise ValueError(f"sequence {seq_id}: unknown, and the step does not carry its state")
            table = None
            if tstart[i]:  # it lost the state: the whole table is memsvc's
                if self.tables is None:
                    raise ValueError(f"sequence {seq_id}: unknown, and the step holds only a change to "
                                     "its table (no `tables` to ask memsvc for the whole one)")
                table = self.tables([seq_id])[0]
            sp, prompt = seq.sampling, seq.prompt_token_ids
            history = (prompt + seq.output_token_ids)[:step.start_pos[i]] if sp.uses_penalties else None
            running.admit(seq_id, sp, seq.seed, len(prompt), history, prompt, table)
        fields = {"pool_epoch": step.pool_epoch, "forget": list(step.forget), "step": step.step}
        if steady_decode(step):
            return running.apply_decode(step.seq_ids, step.start_pos, step.table_start, step.num_new_blocks,
                                        step.new_blocks, **fields)
        fed, known = fed_and_known(step)
        return running.apply(step.seq_ids, step.start_pos, step.num_tokens, known, fed, step.sample,
                             step.table_start, step.num_new_blocks, step.new_blocks, **fields)
