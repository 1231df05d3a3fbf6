"""Prompt logprobs in the gateway: `keep` adds the scores a step computed for a sequence's
prompt positions (once: a recompute's again are skipped) and, once every prompt position is
scored, stops asking (a recompute then computes none and may use the prefix cache). The
executor computes them (pagedserve.executor.prompt_logprobs). See docs/ARCHITECTURE.md, "One step"."""
from __future__ import annotations

import dataclasses

from pagedserve.gateway.sequence import Sequence
from pagedserve.wire.protocol import SampleOutput


def keep(seq: Sequence, start: int, out: SampleOutput | None) -> None:
    """Keep a step's prompt logprobs (the step computed from `start`); once every prompt
    position is scored, stop asking."""
    if out is not None and out.prompt_logprobs:
        seq.add_prompt_logprobs(start + 1, out.prompt_logprobs)
    if seq.sampling.prompt_logprobs is not None and len(seq.prompt_logprobs) >= len(seq.prompt_token_ids) - 1:
        seq.sampling = dataclasses.replace(seq.sampling, prompt_logprobs=None)
