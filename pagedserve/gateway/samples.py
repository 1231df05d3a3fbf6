"""n > 1: a request's other samples wait while its first sequence computes the shared prompt.

`hold` gives the first sequence (the parent) a fork point, its last prompt token (each sample
computes that token itself and draws its first token with its own seed), and holds the
others. At the fork point `release` makes each held sample a running copy of the parent's
cache state, for the caller to queue and fork (memsvc Fork). A parent that ends first
(aborted, rejected) hands its samples back through `take`; `drop` forgets one aborted sample.
"""
from __future__ import annotations

from pagedserve.gateway.sequence import Sequence, SeqStatus


class SampleHolds:
    def __init__(self) -> None:
        self.held: dict[str, list[Sequence]] = {}  # parent id -> samples forked at its fork point

    def hold(self, parent: Sequence, samples: list[Sequence]) -> bool:
        """Hold `samples` until `parent` reaches its fork point; False (nothing held) where the
        prompt has nothing to share before the first sample."""
        if len(parent.prompt_token_ids) < 2:
            return False
        parent.fork_at = len(parent.prompt_token_ids) - 1
        self.held[parent.seq_id] = list(samples)
        return True

    def release(self, parent: Sequence) -> list[Sequence]:
        """`parent` reached its fork point: its samples, each now running on a copy of its state."""
        parent.fork_at = None
        samples = self.held.pop(parent.seq_id, [])
        for sample in samples:
            if parent.prompt_logprobs is not None:  # the parent scored the prompt for every sample:
                # complete by now, and shared (read only), not copied n times
                sample.sampling, sample.prompt_logprobs = parent.sampling, parent.prompt_logprobs
            sample.num_computed = parent.num_computed
            sample.num_cached_tokens = parent.num_cached_tokens
            sample.status = SeqStatus.RUNNING
        return samples

    def take(self, parent_id: str) -> list[Sequence]:
        """The samples `parent_id` holds, no longer held (the parent ended before its fork point)."""
        return self.held.pop(parent_id, [])

    def drop(self, seq_id: str) -> None:
        """Forget a held sample (aborted on its own); anything else is not held."""
        for samples in self.held.values():
            for sample in samples:
                if sample.seq_id == seq_id:
                    samples.remove(sample)
                    return
