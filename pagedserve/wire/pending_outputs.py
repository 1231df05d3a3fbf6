"""A step's outputs still on their way from the device (pagedserve.executor.readback makes
them): the executor launches the next step before they reach the host.

`result()` waits for them (pagedserve.wire.step_outputs, the entries `start..stop-1` of
the pass's); `tokens` is the pass's sampled-token tensor on the device, where the next step
reads the tokens it is fed before the host has them (pagedserve.step.running_feed). A part
(`part`) is one caller's share of a merged pass. See docs/ARCHITECTURE.md, "One step".
"""
from __future__ import annotations

from typing import Protocol

from pagedserve.wire.step_outputs import StepOutputs


class Source(Protocol):
    tokens: object  # the device's int64 [S]: entry k's sampled token

    def done(self) -> bool: ...

    def wait(self) -> None: ...  # until done (at once where only `outputs()` makes them done)

    def outputs(self) -> StepOutputs: ...  # the whole pass's, waiting for them (made once)


class PendingOutputs:
    __slots__ = ("source", "start", "stop")

    def __init__(self, source: Source, start: int, stop: int):
        self.source, self.start, self.stop = source, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    @property
    def tokens(self):
        return self.source.tokens

    def part(self, start: int, stop: int) -> PendingOutputs:
        return PendingOutputs(self.source, self.start + start, self.start + stop)

    def done(self) -> bool:
        return self.source.done()

    def wait(self) -> None:
        self.source.wait()

    def result(self) -> StepOutputs:
        whole = self.source.outputs()
        return whole if self.start == 0 and self.stop == len(whole) else whole.part(self.start, self.stop)
