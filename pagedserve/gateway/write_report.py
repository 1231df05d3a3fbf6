"""What a batching loop tells memsvc about its steps, so that the prefix cache holds only
blocks that were written (pagedserve.memsvc.step_stamps, pagedserve.memsvc.unwritten_keys).

Each plan carries `written` (the stamp of the last step that ran: steps run in the order
reserved), `void` (steps were given up after a failure: nothing reserved since that stamp
will run) and `failed` (sequences the executor left out of a step that ran). `void` and
`failed` are kept until a Reserve that carried them is answered. A stamp belongs to the
memsvc process that gave it: a step reserved in another pool never counts as written.
"""
from __future__ import annotations

from pagedserve.wire.reserve_messages import Plan, ReserveResult
from pagedserve.wire.step_delta import StepDelta


class WriteReport:
    def __init__(self) -> None:
        self.written = 0
        self.void = False
        self.failed: list[str] = []
        self.epoch: str | None = None

    def put(self, plan: Plan) -> None:
        plan.written, plan.void, plan.failed = self.written, self.void, list(self.failed)

    def answered(self, plan: Plan, result: ReserveResult) -> None:
        """memsvc settled what `plan` carried."""
        if result.pool_epoch != self.epoch:
            self.epoch, self.written = result.pool_epoch, 0
        if plan.void:
            self.void = False
        if plan.failed:
            told = set(plan.failed)
            self.failed = [s for s in self.failed if s not in told]

    def ran(self, batch: StepDelta) -> None:
        if batch.pool_epoch == self.epoch and batch.stamp > self.written:
            self.written = batch.stamp

    def gave_up(self) -> None:
        self.void = True

    def left_out(self, seq_ids: list[str]) -> None:
        self.failed.extend(seq_ids)
