"""The batching loop's limits (`SchedulerConfig`): flags of the gateway and of the engine, each
declared once here, checked in `__post_init__` (an error names the flag); `resolved` fills
--max-num-seqs from the executor's batch. See docs/ARCHITECTURE.md, "Configuration"."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pagedserve.wire.settings import setting


CPU_MAX_NUM_SEQS = 64  # --max-num-seqs where the executor names no batch of its own


@dataclass
class SchedulerConfig:
    """The batching loop's limits: flags of the gateway (and of the engine), plus fields set
    in process (no flag)."""

    max_num_seqs: int | None = setting(None, "sequences per step (off: the batch the executor is "
                                       "built for, 256 on a GPU (its largest CUDA graph); "
                                       f"{CPU_MAX_NUM_SEQS} on a CPU)")
    max_num_batched_tokens: int = setting(2048, "tokens per step; longer prompts are prefilled "
                                          "in chunks")
    overlap: bool = setting(True, "while the executor runs a step: detokenize, apply stop strings "
                            "and stream the last step's tokens, and plan and reserve the next step "
                            "(a stop string then ends its sequence one step later; the extra token "
                            "is dropped); --no-overlap: one phase after the other")
    enable_chunked_prefill: bool = True
    plan_ahead: bool = True  # with overlap: also plan and reserve step N + 1 while step N runs

    def __post_init__(self) -> None:
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"--max-num-batched-tokens must be positive, got {self.max_num_batched_tokens}"
            )

    def resolved(self, executor_batch: int = 0) -> "SchedulerConfig":
        """With --max-num-seqs, where not given, the batch the executor is built for
        (ModelInfo.max_num_seqs; 0: none named, CPU_MAX_NUM_SEQS)."""
        if self.max_num_seqs is not None:
            return self
        return dataclasses.replace(self, max_num_seqs=executor_batch or CPU_MAX_NUM_SEQS)
