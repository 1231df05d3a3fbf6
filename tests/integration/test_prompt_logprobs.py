"""Prompt logprobs against transformers on tiny random models: the engine's equal the
log-softmax of transformers' logits (logprob, rank, top k) in a mixed batch, over chunked
prefill, and for a prompt an earlier request left in the prefix cache; then the same through
the OpenAI completions endpoint (prompt_logprobs, echo with logprobs, streaming) and gRPC."""
import json

import httpx
import pytest
import torch

from pagedserve.engine import LLMEngine
from pagedserve.wire.protocol import SamplingParams
from tests.support.tiny_models import make_tiny_model, save_tiny_tokenizer

ATOL = 1e-4


@pytest.fixture(scope="module", params=["llama3", "gemma2"])
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_model(path, request.param, tie=request.param.startswith("gemma"))
    save_tiny_tokenizer(path)
    return path, hf


def random_prompt(n, seed):
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference(hf, prompt):
    """[len(prompt) - 1, vocab]: row p is the distribution of prompt token p + 1."""
    with torch.inference_mode():
        return hf(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)


def check(entries, hf, prompt, k):
    ref = reference(hf, prompt)
    assert [e.token_id for e in entries] == prompt[1:]
    target = ref.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    assert torch.allclose(torch.tensor([e.logprob for e in entries]), target, atol=ATOL)
    assert [e.rank for e in entries] == ((ref > target[:, None]).sum(-1) + 1).tolist()
    values, ids = ref.topk(k, -1) if k else (torch.zeros(len(entries), 0), torch.zeros(len(entries), 0))
    assert [[t for t, _ in e.top] for e in entries] == ids.tolist()
    if k:
        assert torch.allclose(torch.tensor([[v for _, v in e.top] for e in entries]), values, atol=ATOL)


def greedy(max_tokens=3, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def test_a_mixed_batch_and_a_cached_prompt(tiny):
    path, hf = tiny
    engine = LLMEngine(model=str(path), block_size=4, kv_tokens=1024, prefix_caching=True)
    prompts = [random_prompt(n, seed) for n, seed in ((19, 1), (9, 2), (12, 3))]
    outs = engine.generate(prompts, [greedy(prompt_logprobs=5), greedy(), greedy(prompt_logprobs=0, n=2)])
    check(outs[0].completions[0].prompt_logprobs, hf, prompts[0], 5)
    assert outs[1].completions[0].prompt_logprobs == []
    for c in outs[2].completions:  # the forked sample gets the same prompt logprobs
        check(c.prompt_logprobs, hf, prompts[2], 0)
    # the first prompt is in the prefix cache now: a plain request hits, a scoring one computes all
    assert engine.generate([prompts[0]], greedy())[0].cached_tokens == 16
    again = engine.generate([prompts[0]], greedy(prompt_logprobs=3))[0]
    assert again.cached_tokens == 0
    check(again.completions[0].prompt_logprobs, hf, prompts[0], 3)
    assert again.completions[0].token_ids == outs[0].completions[0].token_ids
    engine.memory.check_integrity()


def test_chunked_prefill(tiny):
    path, hf = tiny
    engine = LLMEngine(model=str(path), block_size=4, kv_tokens=1024, max_num_batched_tokens=5)
    prompts = [random_prompt(23, 4), random_prompt(6, 5)]
    outs = engine.generate(prompts, [greedy(prompt_logprobs=2), greedy(prompt_logprobs=20)])
    check(outs[0].completions[0].prompt_logprobs, hf, prompts[0], 2)
    check(outs[1].completions[0].prompt_logprobs, hf, prompts[1], 20)
    engine.memory.check_integrity()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A gateway (gRPC and OpenAI HTTP) over a tiny Llama in process."""
    from pagedserve.executor import Executor
    from pagedserve.gateway.openai.server import start_openai
    from pagedserve.gateway.scheduler_config import SchedulerConfig
    from pagedserve.gateway.server import Backend
    from pagedserve.gateway.tokenizer import load_tokenizer
    from pagedserve.memsvc.memory_manager import MemoryConfig, MemoryManager
    from tests.support.gateway_harness import GatewayThread

    path = tmp_path_factory.mktemp("served")
    hf = make_tiny_model(path, "llama3")
    save_tiny_tokenizer(path)
    executor = Executor(str(path), block_size=4)
    memory = MemoryManager(MemoryConfig(num_blocks=128, max_model_len=256))
    executor.attach_pool(memory.register_executor(executor.kv_geometry()))
    tokenizer = load_tokenizer(str(path))
    g = GatewayThread(lambda: Backend(memory, executor, tokenizer),
                      SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=6, overlap=False))
    http = g._call(start_openai(g.gateway, "127.0.0.1", 0))
    g.wait_ready()
    yield g, f"http://127.0.0.1:{http.port}", hf
    g._call(http.stop())
    g.close()


def post(url, body):
    r = httpx.post(url + "/v1/completions", json={"max_tokens": 2, "temperature": 0, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_completions_prompt_logprobs_in_vllm_shape(served):
    _, url, hf = served
    prompt = random_prompt(11, 6)
    ref = reference(hf, prompt)
    body = post(url, {"prompt": prompt, "prompt_logprobs": 2, "n": 2})
    for choice in body["choices"]:
        got = choice["prompt_logprobs"]
        assert got[0] is None and len(got) == len(prompt)
        for p, entry in enumerate(got[1:]):
            token = prompt[p + 1]
            top = ref[p].topk(2).indices.tolist()
            assert set(entry) == {str(t) for t in [token] + top}
            mine = entry[str(token)]
            assert abs(mine["logprob"] - ref[p, token].item()) < ATOL and mine["decoded_token"] == f"w{token}"
            assert mine["rank"] == int((ref[p] > ref[p, token]).sum()) + 1
            assert [entry[str(t)]["rank"] for t in top if t != token] == [r + 1 for r, t in enumerate(top)
                                                                           if t != token]
    assert "prompt_logprobs" not in post(url, {"prompt": prompt})["choices"][0]


def test_echo_with_logprobs_scores_the_echoed_prompt(served):
    _, url, hf = served
    prompt = random_prompt(9, 7)
    ref = reference(hf, prompt)
    text = " ".join(f"w{t}" for t in prompt)  # the tokenizer's decoding of the prompt
    choice = post(url, {"prompt": prompt, "echo": True, "logprobs": 2})["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"].startswith(text) and "prompt_logprobs" not in choice
    assert lp["tokens"][:9] == [f"w{t}" for t in prompt] and len(lp["tokens"]) == 11
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for p in range(8):
        assert abs(lp["token_logprobs"][p + 1] - ref[p, prompt[p + 1]].item()) < ATOL
        assert set(lp["top_logprobs"][p + 1]) == {f"w{t}" for t in ref[p].topk(2).indices.tolist()}
    assert lp["text_offset"][0] == 0 and lp["text_offset"][9] == len(text)
    assert all(v is not None for v in lp["token_logprobs"][1:])


def test_streaming_sends_prompt_logprobs_with_the_first_chunk(served):
    _, url, hf = served
    prompt = random_prompt(8, 8)
    plain = post(url, {"prompt": prompt, "prompt_logprobs": 1})["choices"][0]["prompt_logprobs"]
    events = []
    with httpx.stream("POST", url + "/v1/completions", timeout=60,
                      json={"prompt": prompt, "max_tokens": 3, "temperature": 0, "prompt_logprobs": 1,
                            "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
    choices = [c for e in events for c in e["choices"]]
    assert choices[0]["prompt_logprobs"] == plain
    assert all("prompt_logprobs" not in c for c in choices[1:])
    # echo with logprobs, streamed: the prompt's tokens and logprobs come first
    whole = post(url, {"prompt": prompt, "max_tokens": 3, "echo": True, "logprobs": 1})["choices"][0]
    with httpx.stream("POST", url + "/v1/completions", timeout=60,
                      json={"prompt": prompt, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 1,
                            "stream": True}) as r:
        chunks = [json.loads(line[6:])["choices"][0] for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [v for c in chunks for v in c["logprobs"][key]] == whole["logprobs"][key]


def test_grpc_generate_returns_prompt_logprobs(served):
    from pagedserve.wire.v1 import generation_pb2 as pb
    from tests.support.gateway_harness import greedy as pb_greedy

    g, _, hf = served
    prompt = random_prompt(10, 9)
    ref = reference(hf, prompt)
    responses = list(g.stub.Generate(pb.GenerateRequest(prompt_token_ids=prompt,
                                                        sampling=pb_greedy(2, prompt_logprobs=1))))
    first = list(responses[0].prompt_logprobs)
    assert [e.token_id for e in first] == prompt[1:] and not any(r.prompt_logprobs for r in responses[1:])
    for p, e in enumerate(first):
        assert abs(e.logprob - ref[p, prompt[p + 1]].item()) < ATOL
        assert [t.token_id for t in e.top] == [int(ref[p].argmax())]
    with pytest.raises(Exception, match="prompt_logprobs must be between 0 and 20"):
        list(g.stub.Generate(pb.GenerateRequest(prompt_token_ids=prompt,
                                                sampling=pb_greedy(2, prompt_logprobs=21))))


def test_across_the_wire_with_chunks_and_a_cached_prompt(tmp_path):
    """memsvc and the executor behind their gRPC services (in this process): the prompt
    travels once in the sequence's state, prompt-only outputs come back for the chunks,
    and memsvc skips the cached prefix for the scoring request."""
    from concurrent import futures

    import grpc

    from pagedserve.executor import Executor
    from pagedserve.executor.pool_register import register
    from pagedserve.executor.server import ExecutorService
    from pagedserve.gateway.batch_loop import BatchLoop
    from pagedserve.gateway.remote import RemoteExecutorClient, RemoteMemoryClient
    from pagedserve.gateway.scheduler_config import SchedulerConfig
    from pagedserve.memsvc.memory_manager import MemoryConfig, MemoryManager
    from pagedserve.memsvc.server import MemoryService
    from pagedserve.wire.v1 import executor_pb2_grpc, memory_pb2_grpc

    hf = make_tiny_model(tmp_path, "qwen3")
    ex = Executor(str(tmp_path), block_size=4)
    manager = MemoryManager(MemoryConfig(num_blocks=64, max_model_len=256))
    memsvc, service = MemoryService(manager), ExecutorService()
    servers, addresses = [], []
    for add, servicer in ((memory_pb2_grpc.add_MemoryManagerServicer_to_server, memsvc),
                          (executor_pb2_grpc.add_ExecutorServicer_to_server, service)):
        server = grpc.server(futures.ThreadPoolExecutor(4))
        add(servicer, server)
        addresses.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
        server.start()
        servers.append(server)
    info = ex.model_info()
    _, epoch = register(addresses[0], info, "cpu", 30.0)
    ex.attach_pool(manager.pool)
    service.set_ready(ex, info, {}, epoch)
    memory, remote = RemoteMemoryClient(addresses[0], heartbeat_s=0), RemoteExecutorClient(addresses[1], timeout=60)
    try:
        loop = BatchLoop(memory, remote, SchedulerConfig(max_num_batched_tokens=5, overlap=False))
        prompt = random_prompt(17, 10)

        def run(request_id, sampling):
            loop.add_request(request_id, prompt, sampling)
            deltas = []
            while loop.has_work():
                deltas += loop.step()
            return deltas

        run("plain", greedy(2))
        deltas = run("scored", greedy(2, prompt_logprobs=4))
        assert deltas[0].cached_tokens == 0 and not any(d.prompt_logprobs for d in deltas[1:])
        check(deltas[0].prompt_logprobs, hf, prompt, 4)
        assert run("again", greedy(2))[0].cached_tokens == 16
    finally:
        memory.close()
        remote.close()
        for server in servers:
            server.stop(0)
        memsvc.close()
