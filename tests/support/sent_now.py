"""In-process clients (pagedserve.wire.clients) that answer as the remote ones do, with no helper thread:
the call is made when it is sent, and its answer (or its error) comes from its Future.
Memory goes through the Reserve message's round trip (pagedserve.benchmarks.step_cost.WireMemory), as
over the wire."""
from pagedserve.benchmarks.step_cost import WireMemory
from pagedserve.wire.clients import ExecutorClient
from pagedserve.rpc.sent import call_now
from pagedserve.step.local_engine import LocalEngine
from pagedserve.wire.step_feed import StepOrder


class SentNowMemory(WireMemory):
    def __getattr__(self, name):  # check_integrity, ...
        return getattr(self.manager, name)


class SentNowExecutor(ExecutorClient):
    """An in-process executor behind the step message, as the executor service runs one:
    one that fails has restarted (what it held is gone, as an executor process's is)."""

    def __init__(self, inner, tables=None):
        self.inner, self.tables = inner, tables  # memsvc's, for the state it sends again
        self.ordered = LocalEngine(inner, tables)

    def model_info(self):
        return self.inner.model_info()

    def step(self, step):
        return call_now(self._execute, step)

    def _execute(self, step):
        try:
            return self.ordered.execute(step)
        except Exception:
            self.ordered = LocalEngine(self.inner, self.tables)
            self.ordered.order = StepOrder(joined=True)
            raise
