"""The Generation service over in-process memsvc and the model-free executor: streaming,
errors, cancellation, deadlines, health and reflection (real gRPC on loopback)."""
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pagedserve.gateway.scheduler_config import SchedulerConfig
from pagedserve.memsvc.memory_manager import MemoryConfig, MemoryManager
from pagedserve.wire.v1 import generation_pb2 as pb
from tests.support.fake_executor import SlowExecutor, reference_next
from tests.support.gateway_harness import GatewayThread, Serialized, collect, greedy, in_process

BLOCK = 4


def make(num_blocks=256, delay=0.0, max_model_len=2048, gate=None):
    ex = SlowExecutor(BLOCK, max_model_len, delay=delay)
    mem = Serialized(MemoryManager(MemoryConfig(num_blocks=num_blocks, max_model_len=max_model_len)))
    ex.attach_pool(mem.register_executor(ex.info.kv))
    backend = in_process(mem, ex)

    def connect():
        if gate is not None and not gate.wait(30):
            raise TimeoutError("gate")
        return backend()

    return GatewayThread(connect, SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=512, overlap=False)), mem


def expected(prompt, n, seed):
    ctx = list(prompt)
    for _ in range(n):
        ctx.append(reference_next(ctx, seed))
    return ctx[len(prompt):]


def wait_unreferenced(mem, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if mem.stats().snapshot["blocks_referenced"] == 0:
            return True
        time.sleep(0.02)
    return False


@pytest.fixture
def gw():
    g, mem = make()
    g.wait_ready()
    yield g, mem
    g.close()


def test_health_not_serving_until_backend_then_serving():
    gate = threading.Event()
    g, _ = make(gate=gate)
    try:
        health = health_pb2_grpc.HealthStub(g.channel)
        req = health_pb2.HealthCheckRequest(service="pagedserve.v1.Generation")
        assert health.Check(req).status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as e:
            g.stub.ListModels(pb.ListModelsRequest())
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        gate.set()
        g.wait_ready()
        assert health.Check(req).status == health_pb2.HealthCheckResponse.SERVING
        assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
        models = g.stub.ListModels(pb.ListModelsRequest()).models
        assert [(m.name, m.max_model_len) for m in models] == [("fake", 2048)]
    finally:
        g.close()


def test_reflection_lists_services(gw):
    g, _ = gw
    stub = reflection_pb2_grpc.ServerReflectionStub(g.channel)
    answers = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {s.name for a in answers for s in a.list_services_response.service}
    assert {"pagedserve.v1.Generation", "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection"} <= names


def test_concurrent_streams_match_reference_and_free_blocks(gw):
    g, mem = gw
    prompts = [[(7 * i + j) % 998 for j in range(3 + i)] for i in range(16)]
    results = [None] * 16

    def run(i):
        req = pb.GenerateRequest(prompt_token_ids=prompts[i], sampling=greedy(12 + i, seed=5),
                                 request_id=f"r{i}")
        results[i] = collect(g.stub.Generate(req))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for i, out in enumerate(results):
        c = out[0]
        assert c["token_ids"] == expected(prompts[i], 12 + i, 5)
        assert c["finish_reason"] == "length"
        assert c["request_id"] == f"r{i}"
        assert c["usage"][:2] == (len(prompts[i]), 12 + i)
    assert wait_unreferenced(mem)
    mem.check_integrity()


def test_n_completions_each_end_with_finish_reason(gw):
    g, _ = gw
    req = pb.GenerateRequest(prompt_token_ids=[1, 2, 3], sampling=greedy(5, n=3, seed=1))
    out = collect(g.stub.Generate(req))
    assert sorted(out) == [0, 1, 2]
    assert all(c["finish_reason"] == "length" and len(c["token_ids"]) == 5 for c in out.values())


BAD = [
    (pb.GenerateRequest(prompt=""), "prompt"),
    (pb.GenerateRequest(prompt_token_ids=[1] * 2048), "maximum length"),
    (pb.GenerateRequest(prompt_token_ids=[1], sampling=pb.SamplingParams(max_tokens=5000)), "max_tokens"),
    (pb.GenerateRequest(prompt_token_ids=[1], sampling=pb.SamplingParams(max_tokens=0)), "max_tokens"),
    (pb.GenerateRequest(prompt_token_ids=[1], sampling=pb.SamplingParams(n=0)), "n must"),
    (pb.GenerateRequest(prompt_token_ids=[1], sampling=pb.SamplingParams(temperature=-0.5)), "temperature"),
    (pb.GenerateRequest(prompt_token_ids=[1], sampling=pb.SamplingParams(top_p=0.0)), "top_p"),
    (pb.GenerateRequest(prompt_token_ids=[1], sampling=pb.SamplingParams(top_p=1.5)), "top_p"),
    (pb.GenerateRequest(prompt_token_ids=[1, 5000]), "prompt_token_ids"),
]


def test_bad_requests_get_invalid_argument_while_others_finish():
    g, mem = make(delay=0.01, num_blocks=64)
    g.wait_ready()
    try:
        good = [g.stub.Generate(pb.GenerateRequest(prompt_token_ids=[i + 1, 2], sampling=greedy(30, seed=i)))
                for i in range(4)]
        for req, field in BAD:
            with pytest.raises(grpc.RpcError) as e:
                list(g.stub.Generate(req))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, e.value.details())
            assert field in e.value.details()
        with pytest.raises(grpc.RpcError) as e:  # as the HTTP API's 404 (tests/unit/gateway/test_served_names.py)
            list(g.stub.Generate(pb.GenerateRequest(prompt_token_ids=[1], model="gpt-9")))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and "'fake'" in e.value.details()
        # the pool holds 256 tokens: this one can never fit
        with pytest.raises(grpc.RpcError) as e:
            list(g.stub.Generate(pb.GenerateRequest(prompt_token_ids=[3] * 10, sampling=greedy(1000))))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
        for i, s in enumerate(good):
            assert collect(s)[0]["token_ids"] == expected([i + 1, 2], 30, i)
        assert wait_unreferenced(mem)
    finally:
        g.close()


def test_cancelled_streams_free_their_blocks():
    g, mem = make(delay=0.005, num_blocks=1024)
    g.wait_ready()
    try:
        streams = [g.stub.Generate(pb.GenerateRequest(prompt_token_ids=[i + 1] * 9,
                                                      sampling=greedy(1500)))
                   for i in range(20)]
        for s in streams:  # every stream is generating
            next(s)
        assert mem.stats().snapshot["blocks_referenced"] > 0
        steps = g.runner.num_steps
        for s in streams:
            s.cancel()
        assert wait_unreferenced(mem)
        assert not g.runner.loop.requests
        assert g.runner.num_steps - steps < 50
        mem.check_integrity()
    finally:
        g.close()


def test_deadline_aborts_the_request():
    g, mem = make(delay=0.005, num_blocks=1024)
    g.wait_ready()
    try:
        with pytest.raises(grpc.RpcError) as e:
            list(g.stub.Generate(pb.GenerateRequest(prompt_token_ids=[1, 2, 3], sampling=greedy(1500)),
                                 timeout=0.5))
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert wait_unreferenced(mem)
        assert not g.runner.loop.requests
    finally:
        g.close()


def test_backend_failure_ends_requests_with_unavailable_and_recovers(gw):
    g, mem = gw
    ex = g.gateway.service.backend.executor
    real = ex.execute

    def broken(batch):
        raise ConnectionError("executor went away")

    ex.execute = broken
    with pytest.raises(grpc.RpcError) as e:
        list(g.stub.Generate(pb.GenerateRequest(prompt_token_ids=[1, 2], sampling=greedy(4))))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    ex.execute = real
    out = collect(g.stub.Generate(pb.GenerateRequest(prompt_token_ids=[1, 2], sampling=greedy(4, seed=3))))
    assert out[0]["token_ids"] == expected([1, 2], 4, 3)
