"""pagedserve.gateway.in_process: objects in this process behind the client interfaces. A step sent
while the one before it runs, or fed by it, runs only once that one succeeded: after a
failure it fails as a step short of its fed tokens would, having changed nothing, so the
failed step can run again first; a step sent after a failure settled runs as usual."""
import threading

import pytest

from pagedserve.gateway.in_process import InProcessExecutor, InProcessMemory, step_clients
from tests.support.fake_executor import FakeExecutor
from pagedserve.wire.clients import ExecutorClient, MemoryClient
from pagedserve.wire.reserve_messages import Plan
from pagedserve.wire.pending_token import PENDING
from pagedserve.wire.step_delta import StepDelta
from pagedserve.wire.step_feed import FedTokenUnknown, lost_feed


class Steps:
    """Stands for the LocalEngine: records the steps run; step 1 fails the first time,
    once `go` is set."""

    def __init__(self):
        self.ran, self.go, self.tries = [], threading.Event(), 0

    def execute(self, step):
        if step.step == 1:
            self.tries += 1
            assert self.go.wait(5)
            if self.tries == 1:
                raise RuntimeError("step 1 failed")
        self.ran.append(step.step)
        return []


def delta(number, token):
    return StepDelta(["a"], [3], [1], [token], [True], [0], [0], [], [None], step=number)


@pytest.mark.parametrize("token", [PENDING, 7])  # fed by step 1, or sent while it ran
def test_a_step_sent_behind_a_failed_one_fails_unrun_and_the_failed_one_runs_again_first(token):
    client = InProcessExecutor(FakeExecutor(4), background=True)
    client.ordered = steps = Steps()
    first = client.step(delta(1, 7))
    behind = client.step(delta(2, token))
    steps.go.set()
    with pytest.raises(RuntimeError, match="step 1 failed"):
        first.result(5)
    error = behind.exception(5)
    assert isinstance(error, FedTokenUnknown) and lost_feed(error) and steps.ran == []
    assert client.step(delta(1, 7)).result(5) == [] and steps.ran == [1]  # the retry
    assert client.step(delta(3, 7)).result(5) == [] and steps.ran == [1, 3]  # the resent step 2
    client.close()


def test_a_step_sent_after_a_failure_settled_runs():
    client = InProcessExecutor(FakeExecutor(4), background=True)
    client.ordered = steps = Steps()
    steps.go.set()
    assert client.step(delta(1, 7)).exception(5) is not None
    assert client.step(delta(2, 7)).result(5) == [] and steps.ran == [2]
    client.close()


def test_objects_are_wrapped_once_and_a_plan_made_ahead_is_reserved_on_a_helper_thread():
    threads = []

    class Memory:
        def reserve(self, plan):
            threads.append(threading.current_thread().name)
            return "granted"

    memory, executor = step_clients(Memory(), FakeExecutor(4), overlap=True)
    assert isinstance(memory, InProcessMemory) and isinstance(executor, InProcessExecutor)
    assert executor.background and step_clients(memory, executor, overlap=False) == (memory, executor)
    assert isinstance(memory, MemoryClient) and isinstance(executor, ExecutorClient)
    assert memory.reserve(Plan([])).result() == "granted"
    assert memory.reserve(Plan([], ahead=True)).result(5) == "granted"
    assert threads[0] == threading.current_thread().name and threads[1].startswith("pagedserve-reserve")
    memory.close()
