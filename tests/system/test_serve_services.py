"""memsvc, executor and gateway as three processes on loopback, with the default model:
health, reflection, outputs identical to the in-process engine, errors, cancellation."""
import json
import threading
import time
from types import SimpleNamespace

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pagedserve.wire.protocol import SamplingParams
from pagedserve.wire.v1 import generation_pb2 as pb
from pagedserve.wire.v1 import generation_pb2_grpc as pb_grpc
from pagedserve.wire.v1 import memory_pb2, memory_pb2_grpc
from tests.support.gateway_harness import collect, greedy
from tests.support.health import NOT_SERVING, SERVING, wait_for_health
from tests.support.serve_procs import TOKEN, free_port, start, stop
from pagedserve.rpc.grpc_service import open_channel
KV_TOKENS = 4096
MAX_SEQS = 16
PROMPTS = ["The capital of France is", "Write a haiku about rain.", "1, 2, 3, 4,",
           "def fibonacci(n):", "Once upon a time", "The best way to learn is",
           "Q: What is 7 times 8?\nA:", "Hello, my name is"]


@pytest.fixture(scope="module")
def services():
    mem_port, ex_port, gw_port = free_port(), free_port(), free_port()
    memsvc, executor, gateway = (f"127.0.0.1:{p}" for p in (mem_port, ex_port, gw_port))
    procs = []
    try:
        procs.append(start("memsvc", "--port", str(mem_port), "--kv-tokens", str(KV_TOKENS)))
        wait_for_health(memsvc, SERVING, proc=procs[-1], timeout=60)
        procs.append(start("gateway", "--port", str(gw_port), "--memsvc", memsvc,
                           "--executor", executor, "--max-num-seqs", str(MAX_SEQS), "--http-port", "0"))
        wait_for_health(gateway, NOT_SERVING, proc=procs[-1], timeout=60)
        time.sleep(0.5)  # no executor yet: still not serving
        wait_for_health(gateway, NOT_SERVING, proc=procs[-1], timeout=1)
        procs.append(start("executor", "--port", str(ex_port), "--memsvc", memsvc))
        wait_for_health(gateway, SERVING, "pagedserve.v1.Generation", procs[-1], timeout=300)
        channel = grpc.insecure_channel(gateway)
        yield SimpleNamespace(gateway=gateway, memsvc=memsvc, procs=procs,
                              stub=pb_grpc.GenerationStub(channel), channel=channel,
                              memory=memory_pb2_grpc.MemoryManagerStub(open_channel(memsvc, token=TOKEN)))
    finally:
        stop(procs[::-1])


@pytest.fixture(scope="module")
def engine():
    from pagedserve.engine import LLMEngine

    return LLMEngine(kv_tokens=KV_TOKENS, max_num_seqs=MAX_SEQS)


def referenced(services) -> int:
    return services.memory.Stats(memory_pb2.StatsRequest(), timeout=5).blocks_referenced


def wait_unreferenced(services, timeout=10.0) -> int:
    deadline = time.monotonic() + timeout
    while (n := referenced(services)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return n


def test_reflection_lists_the_services(services):
    stub = reflection_pb2_grpc.ServerReflectionStub(services.channel)
    answers = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {s.name for a in answers for s in a.list_services_response.service}
    assert {"pagedserve.v1.Generation", "grpc.health.v1.Health"} <= names
    models = services.stub.ListModels(pb.ListModelsRequest()).models
    assert models[0].name == "SmolLM2-135M-Instruct"


def test_16_concurrent_greedy_streams_match_the_engine(services, engine):
    jobs = [(p, chat) for chat in (False, True) for p in PROMPTS]
    expected = engine.generate([p for p, c in jobs if not c], SamplingParams(max_tokens=8, temperature=0))
    expected += engine.generate([p for p, c in jobs if c], SamplingParams(max_tokens=8, temperature=0),
                                chat=True)
    results = [None] * len(jobs)

    def run(i, prompt, chat):
        if chat:
            req = pb.ChatRequest(messages=[pb.ChatMessage(role="user", content=prompt)],
                                 sampling=greedy(8))
            results[i] = collect(services.stub.Chat(req, timeout=300))
        else:
            req = pb.GenerateRequest(prompt=prompt, sampling=greedy(8))
            results[i] = collect(services.stub.Generate(req, timeout=300))

    threads = [threading.Thread(target=run, args=(i, p, c)) for i, (p, c) in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for want, got in zip(expected, results):
        c = want.completions[0]
        assert got[0]["token_ids"] == c.token_ids
        assert got[0]["text"] == c.text
        assert got[0]["finish_reason"] == c.finish_reason
        assert got[0]["usage"][0] == want.prompt_tokens
    assert wait_unreferenced(services) == 0


def test_generate_server_prints_what_offline_prints(services, engine, capsys, monkeypatch):
    from pagedserve import cli, engine as engine_mod

    monkeypatch.setattr(engine_mod, "LLMEngine", lambda config: engine)
    for extra in ([], ["--json"], ["--chat", "--stop", "."]):
        argv = ["generate", "--prompt", "The capital of France is", "--max-tokens", "8", *extra]
        assert cli.main(argv) == 0
        offline = capsys.readouterr().out
        assert cli.main(argv + ["--server", services.gateway]) == 0
        remote = capsys.readouterr().out
        assert remote == offline and offline.strip()
        if "--json" in extra:
            assert json.loads(remote)["finish_reason"] == "length"


BAD = [
    (pb.GenerateRequest(prompt=""), "prompt"),
    (pb.GenerateRequest(prompt_token_ids=[1] * 8192), "maximum length"),
    (pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingParams(max_tokens=9000)), "max_tokens"),
    (pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingParams(temperature=-1)), "temperature"),
    (pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingParams(top_p=0)), "top_p"),
    (pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingParams(top_p=1.01)), "top_p"),
    (pb.GenerateRequest(prompt="Hi", model="llama-70b"), "model"),
    (pb.GenerateRequest(prompt_token_ids=[1, 10**6]), "prompt_token_ids"),
]


def test_tokenize_and_logprobs_match_the_engine(services, engine):
    text = "The capital of France is"
    ids = services.stub.Tokenize(pb.TokenizeRequest(text=text)).token_ids
    assert list(ids) == engine.encode(text)
    [want] = engine.generate([text], SamplingParams(max_tokens=3, temperature=0, logprobs=2))
    got = list(services.stub.Generate(pb.GenerateRequest(prompt=text, sampling=greedy(3, logprobs=2)),
                                      timeout=120))
    lps = [lp for r in got for lp in r.logprobs]
    assert [lp.token_id for lp in lps] == want.completions[0].token_ids
    assert [lp.logprob for lp in lps] == pytest.approx(want.completions[0].logprobs, abs=1e-4)
    assert all(len(lp.top) == 2 for lp in lps)
    assert [[t.token_id for t in lp.top] for lp in lps] == \
        [[t for t, _ in top] for top in want.completions[0].top_logprobs]


def test_bad_requests_get_their_status_while_others_finish(services):
    good = [services.stub.Generate(pb.GenerateRequest(prompt=p, sampling=greedy(6)), timeout=300)
            for p in PROMPTS[:2]]
    for req, field in BAD:
        with pytest.raises(grpc.RpcError) as e:
            list(services.stub.Generate(req, timeout=60))
        want = grpc.StatusCode.NOT_FOUND if field == "model" else grpc.StatusCode.INVALID_ARGUMENT  # as vLLM's 404
        assert e.value.code() == want, (field, e.value.details())
        assert field in e.value.details()
    with pytest.raises(grpc.RpcError) as e:  # 5000 tokens can never fit a 4096-token pool
        list(services.stub.Generate(pb.GenerateRequest(prompt="Hi", sampling=greedy(5000)), timeout=60))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
    for s in good:
        assert collect(s)[0]["finish_reason"] in ("length", "stop")


def test_cancelling_20_streams_frees_every_block(services):
    streams = [services.stub.Generate(pb.GenerateRequest(
        prompt=f"Count to a thousand, number {i}:", sampling=greedy(200, ignore_eos=True)), timeout=300)
        for i in range(20)]
    for s in streams[:MAX_SEQS]:
        next(s)  # these are generating; the other 4 wait for a slot
    assert referenced(services) > 0
    for s in streams:
        s.cancel()
    assert wait_unreferenced(services) == 0


def test_deadline_stops_the_sequence(services):
    with pytest.raises(grpc.RpcError) as e:
        list(services.stub.Generate(pb.GenerateRequest(
            prompt="Tell me a long story.", sampling=greedy(500, ignore_eos=True)), timeout=2.0))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_unreferenced(services) == 0
