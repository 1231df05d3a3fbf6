"""The two interfaces through which the gateway's batching loop sees memsvc and the executor:
the contract between the services.

Each is one object whose step call (`MemoryClient.reserve`, `ExecutorClient.step`) is sent
when made and returns a concurrent Future of its answer, so the loop can keep a call in
flight while it works (docs/ARCHITECTURE.md, "The step path"). Across processes they are
the gRPC clients (pagedserve.gateway.remote), whose Futures are `Sent` (pagedserve.rpc.sent):
read on the thread that asks, with no helper thread; in process, pagedserve.gateway.in_process. Retrying and telemetry are at most
two wrappers of the step call (pagedserve.gateway.step_retry, pagedserve.gateway.step_telemetry).

Errors come out of the Future's `result()`: in process, a bad argument is a ValueError
(or KeyError, IndexError) and a pool that does not exist yet a RuntimeError; across
processes they are grpc.RpcError with INVALID_ARGUMENT, FAILED_PRECONDITION or
UNAVAILABLE (see pagedserve.memsvc.server, pagedserve.executor.server).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future

from pagedserve.wire.protocol import ModelInfo, PoolStats
from pagedserve.wire.step_outputs import StepOutputs
from pagedserve.wire.reserve_messages import Plan, ReserveResult
from pagedserve.wire.step_delta import StepDelta


class MemoryClient(ABC):
    """memsvc: owns the KV pool and decides which sequence gets which slots."""

    @abstractmethod
    def reserve(self, plan: Plan) -> Future[ReserveResult]:
        """Fork `plan.forks` (parent, child) and free `plan.free`, then grant slots to the
        plan's running sequences (`run_ids`) and its new `entries`, in that order (priority
        order). The grants come in columns (pagedserve.wire.reserve_messages.Grants), each carrying the change
        to its sequence's block table since its last grant (`table_start`, `new_blocks`).

        Every running entry is granted, preempted (mode "swap" or "recompute") or, when
        memsvc no longer holds it, reported preempted for recompute; a new entry is granted
        (its cached prompt prefix in `num_cached`), left `waiting` or `rejected`
        (it can never fit); swapped-out entries brought back are `resumed`. Block copies
        are done before it answers. `pool_epoch` names the pool the grants are in: the
        caller puts it in the step it executes.
        """

    @abstractmethod
    def free(self, seq_ids: list[str]) -> None:
        """Release the sequences' blocks now; unknown ids are ignored."""

    def tables(self, seq_ids: list[str]) -> list[list[int]]:
        """Each sequence's whole block table ([] where memsvc does not hold it): memsvc
        holds the tables of record; the gateway asks when an executor must get a state
        again (pagedserve.wire.step_delta.encode_delta). Not a step call: answered at once."""
        raise NotImplementedError(f"{type(self).__name__} does not answer tables")

    @abstractmethod
    def fork(self, parent_id: str, child_id: str) -> None:
        """`child_id` shares every block of `parent_id` (copy-on-write from here on)."""

    @abstractmethod
    def stats(self) -> PoolStats:
        """The pool's accounting and memsvc's counters."""


class ExecutorClient(ABC):
    """The executor: runs the model over the pool memsvc shares with it."""

    @abstractmethod
    def model_info(self) -> ModelInfo:
        """The model: name, maximum length, vocabulary, EOS ids, chat template, KV geometry,
        and where its tokenizer is. Constant for the executor's life."""

    @abstractmethod
    def step(self, step: StepDelta) -> Future[StepOutputs]:
        """Run one step (pagedserve.wire.step_delta: per sequence the tokens to compute and the change
        to its block table): write each sequence's K/V into its slots and answer its
        outputs (pagedserve.wire.step_outputs: one per sequence that reports (it samples, or has prompt logprobs to
        return for its step: pagedserve.step.step_batch.StepBatch.reports), in step order). Steps run in the order of
        `step.step` (pagedserve.wire.step_feed.StepOrder), whatever order they come in; a token PENDING
        (pagedserve.wire.pending_token) is the one the executor sampled for the sequence last step
        (FedTokenUnknown, or FAILED_PRECONDITION across processes, when it does not hold
        it). A step whose `pool_epoch` names a pool other than the executor's is refused
        (ABORTED across processes): its reservation is gone. `step.forget` names sequences
        finished or preempted since the last step: their state is dropped."""
