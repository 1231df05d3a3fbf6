"""Scale-out pieces without processes: the executor's step merger, the router, the block watch."""
import threading
import time
from types import SimpleNamespace

from executor.step_merger import StepMerger
from gateway.router import Router
from wire.block_keys import cacheable_blocks, prompt_block_keys
from wire.protocol import SampleOutput, SamplingParams, SeqStep, StepBatch


def step(seq_id, sample=True):
    return SeqStep(seq_id, [1], 0, [0], [0], sample, SamplingParams(), 0)


def test_merger_runs_one_pass_at_a_time_and_splits_outputs_by_position():
    passes, running = [], []

    def execute(batch):
        assert not running, "two passes at once"
        running.append(1)
        time.sleep(0.05)
        passes.append([s.seq_id for s in batch.seqs])
        running.pop()
        return [SampleOutput(s.seq_id, i) for i, s in enumerate(batch.seqs) if s.sample]

    merger = StepMerger(execute)
    results = {}

    def call(name, n):
        # the same seq ids from every caller (two gateways both say "0/0")
        batch = StepBatch([step("0/0"), step("0/1", sample=False), *[step(f"x{i}") for i in range(n)]])
        results[name] = merger.run(batch)

    threads = [threading.Thread(target=call, args=(f"g{i}", i)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(len(p) for p in passes) == sum(2 + i for i in range(4))
    assert len(passes) < 4  # calls that arrived during a pass were merged
    for i in range(4):
        assert len(results[f"g{i}"]) == 1 + i
        assert results[f"g{i}"][0].seq_id == "0/0"


def test_merger_fails_every_call_of_a_failed_pass_and_goes_on():
    calls = []

    def execute(batch):
        calls.append(batch)
        if len(calls) == 1:
            raise ValueError("bad slot")
        return [SampleOutput(s.seq_id, 0) for s in batch.seqs]

    merger = StepMerger(execute)
    try:
        merger.run(StepBatch([step("a")]))
        raise AssertionError("no error")
    except ValueError:
        pass
    assert merger.run(StepBatch([step("b")]))[0].seq_id == "b"


class FakeIndex:
    def __init__(self, keys=(), usage=0.0):
        self.keys, self.usage = set(keys), usage

    def leading(self, keys):
        n = 0
        for k in keys:
            if k not in self.keys:
                break
            n += 1
        return n

    def note_routed(self, keys):
        self.keys.update(keys)

    def kv_usage(self):
        return self.usage


def replica(name, keys=(), queued=0, usage=0.0):
    return SimpleNamespace(name=name, index=FakeIndex(keys, usage), queued=lambda: queued)


def test_prefix_routing_follows_the_cached_prefix_unless_the_holder_is_loaded():
    prompt = list(range(100))
    keys = prompt_block_keys(prompt, 16, max_blocks=cacheable_blocks(100, 16))
    assert len(keys) == 6
    router = Router("prefix", block_size=16, max_num_seqs=8, registry=None)
    holder, other = replica("a", keys), replica("b")
    for _ in range(3):
        assert router.choose([other, holder], prompt).replica is holder
    route = router.choose([other, holder], prompt)
    assert route.reason == "prefix" and route.cached_blocks == 6
    assert route.attributes()["pagedserve.route.replica"] == "a"
    busy = replica("a", keys, queued=16, usage=0.9)  # score 0.96 - 0.5 * (0.9 + 2) < 0
    assert router.choose([other, busy], prompt).replica is other


def test_prefix_routing_sends_a_new_prefix_to_the_least_loaded_then_keeps_it_there():
    router = Router("prefix", block_size=16, max_num_seqs=8, registry=None)
    a, b = replica("a", queued=4), replica("b", queued=0)
    first = router.choose([a, b], list(range(40)))
    assert first.replica is b and first.reason == "load"
    assert router.choose([a, b], list(range(40)) + [7]).replica is b  # noted before memsvc says


def test_round_robin_takes_turns():
    router = Router("round-robin", block_size=16, registry=None)
    a, b = replica("a"), replica("b")
    names = [router.choose([a, b], [1, 2, 3]).replica.name for _ in range(4)]
    assert names == ["a", "b", "a", "b"]


def test_block_watch_sends_a_snapshot_then_changes():
    from memsvc.block_watch import BlockWatch

    pool = SimpleNamespace(cached={b"k1": 1, b"k2": 2})
    allocator = SimpleNamespace(pool=pool, num_free_blocks=lambda: 5, sequence_ids=lambda: ["s"])
    manager = SimpleNamespace(allocator=allocator, geometry=SimpleNamespace(block_size=16),
                              pool=SimpleNamespace(shape=(8,)))
    watch = BlockWatch()
    first = watch.next_events(manager, "epoch")
    assert first.snapshot and set(first.stored) == {b"k1", b"k2"} and first.num_blocks == 8
    del pool.cached[b"k1"]
    pool.cached[b"k3"] = 3
    second = watch.next_events(manager, "epoch")
    assert not second.snapshot and list(second.stored) == [b"k3"] and list(second.evicted) == [b"k1"]


def test_memsvc_admits_no_new_sequence_for_a_session_over_its_share():
    from memsvc.memory_manager import MemoryConfig, MemoryManager
    from wire.protocol import KVGeometry, Plan, PlanEntry

    mem = MemoryManager(MemoryConfig(num_blocks=32, session_lease_s=10.0))
    mem.register_executor(KVGeometry(1, 1, 1, 4))

    def new(seq_id, first):  # 20 tokens: 5 blocks of 4
        return PlanEntry(seq_id, list(range(first, first + 20)), True, 40)

    assert mem.reserve(Plan([new("0", 100)]), session_id="hog").grants
    assert mem.reserve(Plan([new("0", 200)]), session_id="other").grants  # two sessions: 16 blocks each
    for i in (1, 2, 3):  # holding 5, 10, 15 < 16: admitted
        assert [g.seq_id for g in mem.reserve(Plan([new(str(i), 100 * i + 300)]), session_id="hog").grants] == [str(i)]
    held = mem.reserve(Plan([new("4", 900)]), session_id="hog")  # 20 >= 16: waits
    assert held.grants == [] and held.waiting == ["4"]
    later = mem.reserve(Plan([new("1", 1000)]), session_id="other")  # the other one still starts
    assert [g.seq_id for g in later.grants] == ["1"]
    mem.check_integrity()


def test_serve_with_replicas_and_gateways_starts_each_pair_then_every_gateway_on_all_of_them():
    import argparse

    from pagedserve.serve_cmd import add_parsers, service_specs, with_reliability

    parser = argparse.ArgumentParser()
    add_parsers(parser.add_subparsers())
    args = parser.parse_args(["serve", "--replicas", "2", "--gateways", "2", "--port", "7000",
                              "--routing", "round-robin", "--session-lease", "3", "--metrics-port", "9000"])
    specs = with_reliability(service_specs(args), args)
    assert [s.name for s in specs] == ["memsvc", "executor", "memsvc-1", "executor-1", "gateway", "gateway-1"]
    assert specs[0].restart_with == ["executor"] and specs[2].restart_with == ["executor-1"]
    pairs = [f"{specs[i].address},{specs[i + 1].address}" for i in (0, 2)]
    for i, gateway in enumerate(specs[4:]):
        argv = gateway.argv
        assert gateway.address == f"127.0.0.1:{7000 + i}"
        assert [argv[j + 1] for j, a in enumerate(argv) if a == "--replica"] == pairs
        assert argv[argv.index("--routing") + 1] == "round-robin"
        assert argv[argv.index("--http-port") + 1] == ("8000" if i == 0 else "0")
        assert argv[argv.index("--metrics-port") + 1] == ("9000" if i == 0 else "0")
    assert float(specs[2].argv[specs[2].argv.index("--session-lease") + 1]) == 3
    single = service_specs(parser.parse_args(["serve"]))
    assert [s.name for s in single] == ["memsvc", "executor", "gateway"]


def test_dns_discovery_names_a_replica_per_address_and_the_set_adds_each_once():
    from gateway.discovery import dns_replicas, parse_ports
    from gateway.replica_set import ReplicaSet

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


class FakeRunner:
    def __init__(self):
        self.sinks, self.aborted = {}, []
        self.loop = SimpleNamespace(info="info", scheduler=SimpleNamespace(running=[], waiting=[]))

    def submit(self, request_id, prompt, sampling, sink, priority=0):
        from concurrent.futures import Future

        self.sinks[request_id] = sink
        done = Future()
        done.set_result(None)
        return done

    def abort(self, request_id):
        self.aborted.append(request_id)

    def stop(self, timeout=5.0):
        pass


def fake_replica_set(n):
    import grpc

    from gateway.replica_set import ReplicaSet

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
    from wire.protocol import Delta

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


def test_merger_waits_briefly_for_an_active_caller_so_two_gateways_share_passes():
    sizes = []

    def execute(batch):
        time.sleep(0.02)
        sizes.append(len(batch.seqs))
        return [SampleOutput(s.seq_id, 0) for s in batch.seqs]

    merger = StepMerger(execute, window=1.0, max_wait_s=0.05)

    def gateway(name):  # steps in turn: each waits for its answer, then plans for 2 ms
        for _ in range(10):
            assert len(merger.run(StepBatch([step(name)]), caller=name)) == 1
            time.sleep(0.002)

    threads = [threading.Thread(target=gateway, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(sizes) == 20 and sizes.count(2) >= 5


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
