"""pagedserve.gateway.replica_set without processes: DNS discovery, a failed replica's requests moving
to another, waiting for a replica, the routing decision as a metric and a span attribute."""
from types import SimpleNamespace

from pagedserve.gateway.router import Router
from pagedserve.wire.protocol import SamplingParams
from tests.support.fake_runner import FakeRunner


def test_dns_discovery_names_a_replica_per_address_and_the_set_adds_each_once():
    from pagedserve.gateway.discovery import dns_replicas, parse_ports
    from pagedserve.gateway.replica_set import ReplicaSet

    found = dns_replicas("localhost", 50052, 50053)
    assert ("127.0.0.1:50052", "127.0.0.1:50053") in found or ("[::1]:50052", "[::1]:50053") in found
    assert dns_replicas("no-such-host.invalid", 1, 2) == []
    assert parse_ports("7,8") == (7, 8)
    answers = [[("a:1", "a:2")], [("a:1", "a:2"), ("b:1", "b:2")]]
    replicas = ReplicaSet([], connect=None, make_runner=None, router=None,
                          discover=lambda: answers.pop(0), discover_s=0.0)
    replicas._discover()
    replicas._discover()
    assert [(r.name, r.memsvc, r.executor) for r in replicas.replicas] == [("r0", "a:1", "a:2"),
                                                                            ("r1", "b:1", "b:2")]


def fake_replica_set(n):
    import grpc

    from pagedserve.gateway.replica_set import ReplicaSet

    runners = []

    def connect(memsvc, executor):
        closable = SimpleNamespace(close=lambda: None)
        return SimpleNamespace(memory=SimpleNamespace(channel=grpc.insecure_channel("127.0.0.1:1"),
                                                      close=lambda: None),
                               executor=closable, tokenizer=None, probe=lambda: None)

    def make_runner(backend, on_error):
        runners.append(FakeRunner())
        runners[-1].on_error = on_error
        return runners[-1]

    replicas = ReplicaSet([(f"m{i}", f"e{i}") for i in range(n)], connect, make_runner,
                          Router("round-robin", block_size=4, registry=None), probe_s=60)
    replicas.connect_any()
    return replicas, runners


def delta(index, tokens, finish=None):
    from pagedserve.wire.protocol import Delta

    return Delta("q", index, "".join(map(str, tokens)), tokens, finish)


def test_a_failed_replica_s_requests_move_and_skip_what_was_streamed():
    replicas, (r0, r1) = fake_replica_set(2)
    got = []
    replicas.submit("q", [1, 2, 3], SamplingParams(max_tokens=4), got.append)
    assert "q" in r0.sinks
    r0.sinks["q"]([delta(0, [7])])
    r0.sinks["q"]([delta(0, [8])])
    r0.on_error(RuntimeError("executor gone"))  # the step runner's retry reports it
    assert r0.aborted == ["q"] and "q" in r1.sinks and not replicas.replicas[0].up
    r0.sinks["q"]([delta(0, [99])])  # a stale attempt: dropped
    for t in (7, 8, 9):
        r1.sinks["q"]([delta(0, [t])])  # recomputed: 7 and 8 again, then new
    r1.sinks["q"]([delta(0, [10], "length")])
    assert [d.token_ids for batch in got for d in batch] == [[7], [8], [9], [10]]
    assert "q" not in replicas._requests


def test_a_request_with_no_replica_up_waits_for_one():
    replicas, (r0,) = fake_replica_set(1)
    r0.on_error(RuntimeError("down"))
    got = []
    assert replicas.submit("q", [1], SamplingParams(max_tokens=1), got.append).result() is None
    assert "q" not in r0.sinks
    replicas._try_connect(replicas.replicas[0])  # its probe answers again
    assert "q" in r0.sinks


def test_the_routing_decision_is_a_metric_and_a_span_attribute():
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    replicas, (r0, r1) = fake_replica_set(2)
    replicas.router = Router("prefix", block_size=4, max_num_seqs=8, registry=registry)
    span = SimpleNamespace(attrs={})
    span.set_attributes = span.attrs.update
    replicas.telemetry = SimpleNamespace(open={"q": SimpleNamespace(span=span)})
    replicas.submit("q", list(range(9)), SamplingParams(max_tokens=1), lambda item: None)
    assert span.attrs["pagedserve.route.reason"] == "load"
    assert span.attrs["pagedserve.route.replica"] in ("r0", "r1")
    value = registry.get_sample_value("pagedserve:routing_decisions_total",
                                      {"replica": span.attrs["pagedserve.route.replica"], "reason": "load"})
    assert value == 1


def test_the_set_reports_when_no_replica_is_up_and_when_one_is_again():
    replicas, (r0, r1) = fake_replica_set(2)
    changes = []
    replicas.on_change = changes.append
    r0.on_error(RuntimeError("down"))
    assert changes == []
    r1.on_error(RuntimeError("down"))
    assert changes == [False]
    replicas._try_connect(replicas.replicas[1])
    assert changes == [False, True]
    r0.loop.scheduler.waiting.append(SimpleNamespace(request_id="x"))
    r1.loop.scheduler.running.append(SimpleNamespace(request_id="y"))
    queues = replicas.queues()
    assert [s.request_id for s in queues.waiting] == ["x"] and [s.request_id for s in queues.running] == ["y"]
