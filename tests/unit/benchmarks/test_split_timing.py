"""bench split's timing wrappers: both the sending of a step call (pagedserve.wire.clients) and the wait
for its answer count as the call's time."""
import time

from pagedserve.benchmarks.split import TimedMemory
from pagedserve.wire.clients import MemoryClient
from pagedserve.rpc.sent import Sent


class Slow(MemoryClient):
    def reserve(self, plan):
        time.sleep(0.01)  # sending
        return Sent(lambda: (time.sleep(0.02), "answer")[1])

    free = fork = stats = None


def test_a_step_call_is_timed_whole():
    memory = TimedMemory(Slow())
    answer = memory.reserve("plan")
    sent = memory.seconds["reserve"]
    assert sent >= 0.01  # sleeps give lower bounds only: nothing here depends on speed
    assert answer.result() == "answer" and memory.seconds["reserve"] >= sent + 0.02


def test_the_split_services_get_no_http_api_and_the_executor_a_metrics_port():
    """bench split reads the executor's Execute time from its metrics port; the HTTP API
    (whose packages the GPU machine's image lacks) stays off."""
    from pagedserve.benchmarks.split import serve_namespace, with_executor_metrics
    from pagedserve.cli import build_parser
    from pagedserve.serve_cmd import service_specs

    args = build_parser().parse_args(["bench", "split", "--kv-tokens", "1024"])
    specs = {s.name: s for s in with_executor_metrics(service_specs(serve_namespace(args, port=7100)), 7199)}
    gateway = specs["gateway"].argv
    assert gateway[gateway.index("--http-port") + 1] == "0"
    executor = specs["executor"].argv
    assert executor[executor.index("--metrics-port") + 1] == "7199" and executor.count("--metrics-port") == 1
