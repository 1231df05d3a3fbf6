"""A pass's sampled tokens (and logprobs) on their way to the host, without a wait.

On a GPU each tensor is copied into pinned memory with a non-blocking copy, and a CUDA event
marks the copies' end: `done()` asks the event, `outputs()` waits for it and makes the
pass's StepOutputs (pagedserve.wire.step_outputs) once. `tokens` stays on the device, where
the next step reads the tokens it is fed (pagedserve.wire.pending_outputs). On a CPU the
tensors are the host's already; `held=True` reports them not done until `outputs()` is
asked, so that a CPU's pass stays in flight as a GPU's does (the tests' way to run the GPU's
order of calls). See docs/ARCHITECTURE.md, "One step".
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.wire.protocol import SampleOutput
from pagedserve.wire.step_outputs import StepOutputs


@dataclass
class Logprobs:
    """The logprobs the rows `asked` (entries) ask for, `counts[j]` top ones for row j:
    the chosen token's [A], and the `max(counts)` most likely values and tokens [A, m]."""
    asked: list[int]
    counts: list[int]
    chosen: torch.Tensor
    values: torch.Tensor
    top: torch.Tensor


class Readback:
    def __init__(self, seq_ids: list[str], tokens: torch.Tensor, logprobs: Logprobs | None = None,
                 held: bool = False):
        self.seq_ids, self.tokens, self.logprobs = seq_ids, tokens, logprobs
        tensors = [tokens] if logprobs is None else [tokens, logprobs.chosen, logprobs.values, logprobs.top]
        self._event = None
        if tokens.is_cuda:
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                          for t in tensors]
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = tensors
        self._held = held
        self._outputs: StepOutputs | None = None

    def done(self) -> bool:
        if self._outputs is not None:
            return True
        return not self._held and (self._event is None or self._event.query())

    def wait(self) -> None:
        """Until the copies are done (the host's side; held outputs: at once)."""
        if self._event is not None:
            self._event.synchronize()

    def outputs(self) -> StepOutputs:
        if self._outputs is None:
            if self._event is not None:
                self._event.synchronize()
            out = StepOutputs(self.seq_ids, self._host[0].tolist())
            if self.logprobs is not None:
                self._put_logprobs(out, *(t.tolist() for t in self._host[1:]))
            self._outputs = out
        return self._outputs

    def _put_logprobs(self, out: StepOutputs, chosen: list, values: list, top: list) -> None:
        lp = self.logprobs
        for j, (k, n) in enumerate(zip(lp.asked, lp.counts)):
            top_n = [(t, v) for t, v in zip(top[j][:n], values[j][:n]) if v != float("-inf")] if n else []
            out.put(k, SampleOutput(out.seq_ids[k], out.tokens[k], chosen[j], top_n))
