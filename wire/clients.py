"""The two interfaces through which the gateway sees memsvc and the executor: the contract
between the services.

In process they are implemented by direct calls (memsvc.memory_manager.MemoryManager,
executor.Executor); across processes by the gRPC clients (gateway.remote). Wrappers
(retrying, telemetry, timing) implement them too, method by method. The batching loop
only ever talks to these.

A client with `calls_later` (the gRPC ones, and the wrappers around them) also has
`reserve_later` / `execute_later`: the call is sent now and the function returned waits
for its answer on the thread that calls it (raising the call's error), so the batching
loop keeps a call in flight without a helper thread (gateway.step_pipeline).

Errors: in process, a bad argument is a ValueError (or KeyError, IndexError) and a pool
that does not exist yet a RuntimeError; across processes they are grpc.RpcError with
INVALID_ARGUMENT, FAILED_PRECONDITION or UNAVAILABLE (see memsvc.server, executor.server).
"""
from __future__ import annotations

from typing import Callable, Protocol

from wire.protocol import ModelInfo, Plan, PoolStats, ReserveResult, SampleOutput
from wire.step_delta import StepDelta


class MemoryClient(Protocol):
    """memsvc: owns the KV pool and decides which sequence gets which slots."""

    def reserve(self, plan: Plan) -> ReserveResult:
        """Fork `plan.forks` (parent, child) and free `plan.free`, then grant slots to the
        plan's running sequences (`run_ids`) and its new `entries`, in that order (priority
        order). The grants come in columns (wire.protocol.Grants), each carrying the change
        to its sequence's block table since its last grant (`table_start`, `new_blocks`).

        Every running entry is granted, preempted (mode "swap" or "recompute") or, when
        memsvc no longer holds it, reported preempted for recompute; a new entry is granted
        (its cached prompt prefix in `num_cached`), left `waiting` or `rejected`
        (it can never fit); swapped-out entries brought back are `resumed`. Block copies
        are done before it returns. `pool_epoch` names the pool the grants are in: the
        caller puts it in the StepBatch it executes.
        """
        ...

    def free(self, seq_ids: list[str]) -> None:
        """Release the sequences' blocks now; unknown ids are ignored."""
        ...

    def tables(self, seq_ids: list[str]) -> list[list[int]]:
        """Each sequence's whole block table ([] where memsvc does not hold it): memsvc
        holds the tables of record; the gateway asks when an executor must get a state
        again (wire.step_delta.encode_delta)."""
        ...

    def fork(self, parent_id: str, child_id: str) -> None:
        """`child_id` shares every block of `parent_id` (copy-on-write from here on)."""
        ...

    def stats(self) -> PoolStats:
        """The pool's accounting and memsvc's counters."""
        ...


class ExecutorClient(Protocol):
    """The executor: runs the model over the pool memsvc shares with it."""

    def model_info(self) -> ModelInfo:
        """The model: name, maximum length, vocabulary, EOS ids, chat template, KV geometry,
        and where its tokenizer is. Constant for the executor's life."""
        ...

    def execute(self, step: StepDelta) -> list[SampleOutput]:
        """Run one step (wire.step_delta: per sequence the tokens to compute and the change
        to its block table): write each sequence's K/V into its slots and return one
        SampleOutput per sequence that reports (it samples, or has prompt logprobs to
        return for its step: SeqStep.reports), in step order. A step whose `pool_epoch`
        names a pool other than the executor's is refused (ABORTED across processes): its
        reservation is gone. `step.forget` names sequences finished or preempted since
        the last step: their state is dropped. A token PENDING is the one the executor
        sampled for the sequence last step, and `step.step` orders one caller's steps
        (wire.step_feed). Only an executor with `feeds_itself` (the gRPC client) takes
        StepDelta as it is; the batching loop runs any other (an executor object in
        process, which runs a full StepBatch) through wire.ordered_executor."""
        ...


def failing(error: BaseException) -> Callable:
    """An answer that is `error`, raised when asked for."""
    def fail():
        raise error
    return fail


def call_now(fn: Callable, arg) -> Callable:
    """`fn(arg)` made now, as a call sent: its answer, or its error raised, when asked for
    (an in-process client's `reserve_later` / `execute_later`)."""
    try:
        answer = fn(arg)
    except Exception as e:  # noqa: BLE001 - raised when the answer is asked for
        return failing(e)
    return lambda: answer
