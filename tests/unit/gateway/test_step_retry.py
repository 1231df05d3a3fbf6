"""pagedserve.gateway.step_retry without processes: which failures re-run the same batch, which re-plan
the step, and that an Execute that never succeeded runs before the next Reserve. The fake
clients make each call when it is sent (pagedserve.rpc.sent.call_now); a failure is retried when
the answer is read."""
import grpc
import pytest

from pagedserve.gateway.step_retry import PoolChanged, StepRetry
from pagedserve.wire.clients import ExecutorClient, MemoryClient
from pagedserve.rpc.sent import call_now
from pagedserve.wire.protocol import SampleOutput
from pagedserve.wire.reserve_messages import Plan, ReserveResult
from pagedserve.wire.step_delta import StepDelta


class Err(grpc.RpcError):
    def __init__(self, code):
        self._code = code

    def code(self):
        return self._code

    def details(self):
        return self._code.name


class Memory(MemoryClient):
    def __init__(self, failures=()):
        self.failures = list(failures)
        self.plans = []

    def reserve(self, plan):
        return call_now(self._reserve, plan)

    def _reserve(self, plan):
        if self.failures:
            raise Err(self.failures.pop(0))
        self.plans.append(plan)
        return ReserveResult(pool_epoch="epoch-1")

    free = fork = stats = None


class Executor(ExecutorClient):
    def __init__(self, failures=()):
        self.failures = list(failures)
        self.calls = []

    model_info = None

    def step(self, batch):
        return call_now(self._execute, batch)

    def _execute(self, batch):
        self.calls.append((batch, batch.pool_epoch))
        if self.failures:
            raise Err(self.failures.pop(0))
        return [SampleOutput("a/0", 7)]


U, A = grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED


def make(memory, executor, timeout=5.0):
    retries = []
    return StepRetry(memory, executor, timeout, interval_s=0.001,
                     on_retry=lambda call, e: retries.append(call)), retries


def test_an_unavailable_executor_gets_the_same_batch_again_without_a_new_reserve():
    memory, executor = Memory(), Executor([U, U])
    retry, retries = make(memory, executor)
    retry.memory.reserve(Plan([])).result()
    batch = StepDelta(pool_epoch="epoch-1")
    assert retry.executor.step(batch).result() == [SampleOutput("a/0", 7)]
    assert [c for c in executor.calls] == [(batch, "epoch-1")] * 3
    assert len(memory.plans) == 1 and retries == ["execute", "execute"]


def test_a_changed_pool_means_plan_the_step_again():
    retry, _ = make(Memory(), Executor([U, A]))
    retry.memory.reserve(Plan([])).result()
    with pytest.raises(PoolChanged):
        retry.executor.step(StepDelta()).result()
    assert retry.dirty is None


def test_an_unavailable_memsvc_gets_the_same_plan_again():
    memory = Memory([U, U, U])
    retry, retries = make(memory, Executor())
    plan = Plan([])
    retry.memory.reserve(plan).result()
    assert memory.plans == [plan] and retries == ["reserve"] * 3


def test_other_errors_are_not_retried():
    retry, retries = make(Memory([grpc.StatusCode.INVALID_ARGUMENT]), Executor())
    with pytest.raises(grpc.RpcError):
        retry.memory.reserve(Plan([])).result()
    assert retries == []


def test_a_batch_that_never_ran_runs_before_the_next_reserve():
    memory, executor = Memory(), Executor([U] * 1000)
    retry, _ = make(memory, executor, timeout=0.01)
    retry.memory.reserve(Plan([])).result()
    batch = StepDelta(pool_epoch="epoch-1")
    with pytest.raises(grpc.RpcError):
        retry.executor.step(batch).result()
    assert retry.dirty is batch
    executor.failures = []  # the executor is back
    calls = len(executor.calls)
    retry.memory.reserve(Plan([])).result()
    assert executor.calls[calls] == (batch, "epoch-1") and retry.dirty is None
    assert len(memory.plans) == 2


def test_a_reserve_sent_ahead_is_retried_when_its_answer_is_a_failure():
    memory = Memory([U, U])
    retry, retries = make(memory, Executor())
    plan = Plan([])
    answer = retry.memory.reserve(plan)
    assert retries == [] and memory.plans == []  # the failure waits for the answer to be read
    assert answer.result().pool_epoch == "epoch-1"
    assert memory.plans == [plan] and retries == ["reserve"] * 2


def test_an_execute_sent_ahead_retries_changes_pool_or_goes_dirty_as_a_call_does():
    memory, executor = Memory(), Executor([U])
    retry, retries = make(memory, executor)
    batch = StepDelta(pool_epoch="epoch-1")
    assert retry.executor.step(batch).result() == [SampleOutput("a/0", 7)]
    assert len(executor.calls) == 2 and retries == ["execute"]
    executor.failures = [A]
    with pytest.raises(PoolChanged):
        retry.executor.step(batch).result()
    retry.timeout_s, executor.failures = 0.0, [U] * 5
    answer = retry.executor.step(batch)
    with pytest.raises(grpc.RpcError):
        answer.result()
    assert retry.dirty is batch
    executor.failures = []
    retry.memory.reserve(Plan([])).result()
    assert retry.dirty is None and executor.calls[-1] == (batch, "epoch-1")


class SendsFailing(Executor):
    """An executor client whose call fails while it is being sent (the remote client asks
    memsvc for whole tables when it must send a state again, and memsvc is restarting)."""

    def __init__(self, failures=()):
        super().__init__()
        self.send_failures = list(failures)

    def step(self, batch):
        if self.send_failures:
            raise Err(self.send_failures.pop(0))
        return super().step(batch)


def test_an_error_while_sending_is_retried_as_an_unavailable_answer():
    executor = SendsFailing([U, U])
    retry = StepRetry(Memory(), executor, timeout_s=5, interval_s=0)
    batch = StepDelta(pool_epoch="epoch-1")
    assert retry.executor.step(batch).result() == [SampleOutput("a/0", 7)]
    assert len(executor.calls) == 1 and executor.send_failures == []
    with pytest.raises(PoolChanged):  # as an ABORTED answer is
        StepRetry(Memory(), SendsFailing([A]), timeout_s=5, interval_s=0).executor.step(batch).result()
