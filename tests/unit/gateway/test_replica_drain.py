"""Draining a replica (an executor told to stop says NOT_SERVING): the gateway's replica set
routes nothing new to it while its running requests go on there; the executor waits for its
gateways to go quiet before it stops."""
from types import SimpleNamespace

import grpc

from pagedserve.gateway.replica_set import Draining, ReplicaSet
from pagedserve.gateway.router import Router
from pagedserve.wire.protocol import SamplingParams
from tests.support.fake_runner import FakeRunner


def replica_set(n):
    """n connected fake replicas; `states[i]` is what replica i's probe does (None: SERVING)."""
    runners, states = [], [None] * n

    def connect(memsvc, executor):
        i = int(memsvc[1:])

        def probe():
            if states[i] is not None:
                raise states[i]
        return SimpleNamespace(memory=SimpleNamespace(channel=grpc.insecure_channel("127.0.0.1:1"),
                                                      close=lambda: None),
                               executor=SimpleNamespace(close=lambda: None), tokenizer=None, probe=probe)

    def make_runner(backend, on_error):
        runners.append(FakeRunner())
        runners[-1].on_error = on_error
        return runners[-1]

    replicas = ReplicaSet([(f"m{i}", f"e{i}") for i in range(n)], connect, make_runner,
                          Router("round-robin", block_size=4, registry=None), probe_s=60)
    replicas.connect_any()
    return replicas, runners, states


def delta(tokens, finish=None):
    from pagedserve.wire.protocol import Delta

    return Delta("q", 0, "".join(map(str, tokens)), tokens, finish)


def test_a_draining_replica_gets_no_new_requests_and_finishes_its_own():
    replicas, (r0, r1), states = replica_set(2)
    got = []
    replicas.submit("a", [1], SamplingParams(max_tokens=2), got.append)
    assert "a" in r0.sinks
    states[0] = Draining("executor at e0 is not SERVING")
    replicas.probe(replicas.replicas[0])
    assert replicas.replicas[0].up and replicas.replicas[0].draining
    for i in range(4):  # round-robin would alternate: every new request goes to r1
        replicas.submit(f"n{i}", [1], SamplingParams(max_tokens=1), lambda item: None)
    assert set(r1.sinks) == {"n0", "n1", "n2", "n3"} and set(r0.sinks) == {"a"}
    r0.sinks["a"]([delta([5])])  # the running request goes on where it is
    r0.sinks["a"]([delta([6], "length")])
    assert r0.aborted == [] and [d.token_ids for b in got for d in b] == [[5], [6]]
    assert "a" not in replicas._requests


def test_a_drained_replica_that_goes_away_moves_what_it_still_ran():
    replicas, (r0, r1), states = replica_set(2)
    replicas.submit("a", [1], SamplingParams(max_tokens=3), lambda item: None)
    states[0] = Draining("not SERVING")
    replicas.probe(replicas.replicas[0])
    states[0] = ConnectionError("connection refused")  # the drain timed out: the process is gone
    replicas.probe(replicas.replicas[0])
    assert not replicas.replicas[0].up and r0.aborted == ["a"] and "a" in r1.sinks


def test_a_replica_serving_again_is_routed_to_and_lone_draining_replica_holds_requests():
    replicas, (r0,), states = replica_set(1)
    states[0] = Draining("not SERVING")
    replicas.probe(replicas.replicas[0])
    replicas.submit("w", [1], SamplingParams(max_tokens=1), lambda item: None)
    assert "w" not in r0.sinks  # waits: no replica takes new requests
    states[0] = None
    replicas.probe(replicas.replicas[0])
    assert not replicas.replicas[0].draining and "w" in r0.sinks


def test_the_executor_drains_until_its_gateways_are_quiet():
    from pagedserve.executor.server import drain

    now = [0.0]
    service = SimpleNamespace(serving=True)
    service.set_serving = lambda on: setattr(service, "serving", on)
    calls = {0.5, 1.0, 1.5, 2.0, 2.5}  # a gateway's steps for its running request, then none

    servicer = SimpleNamespace(active=0, last_call=float("-inf"))

    def sleep(s):
        now[0] = round(now[0] + 0.5, 3)
        if now[0] in calls:
            servicer.last_call = now[0]
    assert drain(service, servicer, timeout=30, idle=2.0, clock=lambda: now[0], sleep=sleep)
    assert service.serving is False and now[0] == 4.5  # 2 s after the last call

    now[0], servicer.last_call, servicer.active = 0.0, float("-inf"), 1  # a step that never ends
    assert not drain(service, servicer, timeout=3, idle=2.0, clock=lambda: now[0], sleep=sleep)
    assert now[0] >= 3
