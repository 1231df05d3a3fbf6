"""In-process clients that `calls_later` (wire.clients) as the remote ones do: the call is
made when it is sent, and its answer (or its error) comes when it is asked for. Memory
goes through the Reserve message's round trip (benchmarks.step_cost.WireMemory), as over
the wire."""
from benchmarks.step_cost import WireMemory
from wire.clients import call_now
from wire.ordered_executor import OrderedExecutor
from wire.step_feed import StepOrder


class SentNowMemory(WireMemory):
    def __getattr__(self, name):  # stats, check_integrity, ...
        return getattr(self.manager, name)


class SentNowExecutor:
    """An in-process executor behind the step message, as the executor service runs one:
    one that fails has restarted (what it held is gone, as an executor process's is)."""

    calls_later = True
    feeds_itself = True

    def __init__(self, inner, tables=None):
        self.inner, self.tables = inner, tables  # memsvc's, for the state it sends again
        self.ordered = OrderedExecutor(inner, tables)

    def model_info(self):
        return self.inner.model_info()

    def execute(self, step):
        try:
            return self.ordered.execute(step)
        except Exception:
            self.ordered = OrderedExecutor(self.inner, self.tables)
            self.ordered.order = StepOrder(joined=True)
            raise

    def execute_later(self, step):
        return call_now(self.execute, step)
