"""bench split's timing wrappers: a client that calls later (wire.clients) stays one through
them, and both the sending and the wait for the answer count as the call's time."""
import time

from benchmarks.split import TimedExecutor, TimedMemory


class Later:
    calls_later = True

    def reserve_later(self, plan):
        time.sleep(0.01)  # sending
        return lambda: (time.sleep(0.02), "answer")[1]


class Plain:
    def reserve(self, plan):
        return "answer"


def test_a_client_that_calls_later_stays_one_and_its_call_is_timed_whole():
    memory = TimedMemory(Later())
    assert memory.calls_later and not TimedExecutor(Plain()).calls_later
    answer = memory.reserve_later("plan")
    sent = memory.seconds["reserve"]
    assert sent >= 0.01  # sleeps give lower bounds only: nothing here depends on speed
    assert answer() == "answer" and memory.seconds["reserve"] >= sent + 0.02
    assert not TimedMemory(Plain()).calls_later and TimedMemory(Plain()).reserve("p") == "answer"


def test_the_split_services_get_no_http_api_and_a_metrics_port_each_named_in_their_arguments():
    """bench split reads the executor's Execute time from its metrics port; the HTTP API
    (whose packages the GPU machine's image lacks) stays off."""
    from benchmarks.split import serve_namespace
    from pagedserve.cli import build_parser
    from pagedserve.serve_cmd import service_specs

    args = build_parser().parse_args(["bench", "split", "--kv-tokens", "1024"])
    specs = {s.name: s for s in service_specs(serve_namespace(args, port=7100))}
    assert "--http-port" in specs["gateway"].argv and specs["gateway"].argv[
        specs["gateway"].argv.index("--http-port") + 1] == "0"
    for name in ("memsvc", "executor"):
        argv = specs[name].argv
        assert int(argv[argv.index("--metrics-port") + 1]) > 0
