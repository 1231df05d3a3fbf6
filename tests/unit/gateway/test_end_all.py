"""What a draining gateway asks of its step runner, on both faces of it (pagedserve.gateway.step_runner,
pagedserve.gateway.replica_set): `in_flight()` counts the requests not yet ended, and `end_all` ends
every one of them with a BackendError carrying its message, aborting their sequences."""
import threading
import time

from pagedserve.gateway.batch_loop import BatchLoop
from pagedserve.gateway.scheduler_config import SchedulerConfig
from pagedserve.gateway.step_runner import BackendError, StepRunner
from pagedserve.memsvc.memory_manager import MemoryConfig, MemoryManager
from pagedserve.wire.protocol import SamplingParams
from tests.support.fake_executor import SlowExecutor
from tests.unit.gateway.test_replica_drain import delta, replica_set


class Sink:
    def __init__(self):
        self.items, self.ended = [], threading.Event()

    def __call__(self, item):
        self.items.append(item)
        if isinstance(item, BaseException) or any(d.finish_reason for d in item):
            self.ended.set()


def runner():
    executor = SlowExecutor(4, 4096, delay=0.005)
    memory = MemoryManager(MemoryConfig(num_blocks=4096, max_model_len=4096))
    executor.attach_pool(memory.register_executor(executor.info.kv))
    loop = BatchLoop(memory, executor, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, overlap=False))
    return StepRunner(loop), memory


def test_the_step_runner_counts_its_requests_until_they_finish():
    r, _ = runner()
    try:
        sinks = [Sink() for _ in range(2)]
        for i, sink in enumerate(sinks):
            r.submit(f"q{i}", [1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True), sink).result(5)
        assert r.in_flight() == 2
        for sink in sinks:
            assert sink.ended.wait(10)
        deadline = time.monotonic() + 5
        while r.in_flight() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert r.in_flight() == 0
        assert all(not isinstance(i, BaseException) for s in sinks for i in s.items)
    finally:
        r.stop()


def test_end_all_ends_every_request_of_the_step_runner_with_its_message_and_frees_them():
    r, memory = runner()
    try:
        sinks = [Sink() for _ in range(3)]
        for i, sink in enumerate(sinks):
            r.submit(f"q{i}", [1, 2, 3], SamplingParams(max_tokens=3000, ignore_eos=True), sink).result(5)
        while not all(s.items for s in sinks):
            time.sleep(0.01)
        r.end_all("shutting down: --drain-timeout passed")
        for sink in sinks:
            assert sink.ended.wait(5)
            assert isinstance(sink.items[-1], BackendError) and "--drain-timeout" in str(sink.items[-1])
        assert r.in_flight() == 0 and not r.loop.requests
        r.submit("after", [1], SamplingParams(max_tokens=1), Sink()).result(5)  # it still runs
        deadline = time.monotonic() + 5
        while memory.stats().snapshot["blocks_referenced"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert memory.stats().snapshot["blocks_referenced"] == 0
    finally:
        r.stop()


def test_end_all_ends_the_replica_sets_requests_on_every_replica_and_those_waiting_for_one():
    replicas, (r0, r1), _ = replica_set(2)
    got = {name: [] for name in ("a", "b", "c", "done")}
    for name in ("a", "b", "done"):
        replicas.submit(name, [1], SamplingParams(max_tokens=2), got[name].append)
    (r0.sinks.get("done") or r1.sinks["done"])([delta([5], "length")])
    for replica in replicas.replicas:
        replica.up = False
    replicas.submit("c", [1], SamplingParams(max_tokens=2), got["c"].append)  # no replica up: it waits
    assert replicas.in_flight() == 3
    replicas.end_all("the gateway is shutting down")
    assert replicas.in_flight() == 0
    for name in ("a", "b", "c"):
        assert isinstance(got[name][-1], BackendError) and "shutting down" in str(got[name][-1])
    assert sorted(r0.aborted + r1.aborted) == ["a", "b"]
    assert not any(isinstance(i, BaseException) for i in got["done"])
