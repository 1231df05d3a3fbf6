"""The two interfaces through which the gateway sees memsvc and the executor.

The offline engine implements them by direct calls; the gRPC stubs implement them across
processes. The batching loop only ever talks to these.
"""
from __future__ import annotations

from typing import Protocol

from wire.protocol import ModelInfo, Plan, ReserveResult, SampleOutput, StepBatch


class MemoryClient(Protocol):
    def reserve(self, plan: Plan) -> ReserveResult: ...
    def free(self, seq_ids: list[str]) -> None: ...
    def fork(self, parent_id: str, child_id: str) -> None: ...
    def stats(self): ...


class ExecutorClient(Protocol):
    def model_info(self) -> ModelInfo: ...
    def execute(self, batch: StepBatch) -> list[SampleOutput]: ...
