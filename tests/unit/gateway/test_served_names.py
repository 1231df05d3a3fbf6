"""--served-model-name with several names (pagedserve.wire.served_names), as vLLM's, through the
real gRPC and HTTP servers over the fake executor: /v1/models and ListModels list every name,
a request naming any is served and answered under the first, another model is a 404
(gRPC NOT_FOUND) naming the served ones."""
import grpc
import httpx
import pytest

from pagedserve.gateway.openai.server import start_openai
from pagedserve.gateway.scheduler_config import SchedulerConfig
from pagedserve.memsvc.memory_manager import MemoryConfig, MemoryManager
from pagedserve.wire.protocol import KVGeometry, ModelInfo
from pagedserve.wire.served_names import named, names_of, serves
from pagedserve.wire.v1 import generation_pb2 as pb
from tests.support.fake_executor import FakeExecutor
from tests.support.gateway_harness import GatewayThread, Serialized, greedy, in_process


def serving(names):
    executor = FakeExecutor(4, 512)
    memory = Serialized(MemoryManager(MemoryConfig(num_blocks=256, max_model_len=512)))
    executor.attach_pool(memory.register_executor(executor.info.kv))
    g = GatewayThread(in_process(memory, executor), SchedulerConfig(max_num_seqs=4, overlap=False),
                      served_model_name=names)
    http = g._call(start_openai(g.gateway, "127.0.0.1", 0))
    g.wait_ready()
    g.url = f"http://127.0.0.1:{http.port}"
    g.http = http
    return g


@pytest.fixture(scope="module")
def served():
    g = serving(["first", "second"])
    yield g
    g._call(g.http.stop())
    g.close()


def complete(g, model):
    return httpx.post(g.url + "/v1/completions", json={"model": model, "prompt": [1, 2, 3], "max_tokens": 2},
                      timeout=30)


def generate(g, model):
    return list(g.stub.Generate(pb.GenerateRequest(prompt_token_ids=[1, 2, 3], model=model,
                                                   sampling=greedy(2)), timeout=30))


def test_every_name_is_listed(served):
    assert [m["id"] for m in httpx.get(served.url + "/v1/models").json()["data"]] == ["first", "second"]
    assert [m.name for m in served.stub.ListModels(pb.ListModelsRequest()).models] == ["first", "second"]
    assert httpx.get(served.url + "/v1/models/second").json()["id"] == "second"
    r = httpx.get(served.url + "/v1/models/fake")  # the executor's own name is not served
    assert r.status_code == 404 and "`first`, `second`" in r.json()["error"]["message"]


def test_a_request_by_any_name_is_served_and_answered_under_the_first(served):
    for model in ("second", "first", None):
        r = complete(served, model)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "first" and r.json()["usage"]["completion_tokens"] == 2
    for model in ("second", ""):
        assert generate(served, model)[-1].usage.completion_tokens == 2


def test_another_model_is_vllms_404_naming_the_served_ones(served):
    r = complete(served, "gpt-4")
    assert r.status_code == 404
    error = r.json()["error"]
    assert (error["param"], error["code"]) == ("model", "model_not_found")
    assert error["message"] == "The model `gpt-4` does not exist. This server serves `first`, `second`."
    r = httpx.post(served.url + "/v1/chat/completions", timeout=30,
                   json={"model": "fake", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    with pytest.raises(grpc.RpcError) as e:
        generate(served, "gpt-4")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert "'gpt-4'" in e.value.details() and "'first', 'second'" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        served.stub.Tokenize(pb.TokenizeRequest(text="x", model="gpt-4"), timeout=30)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_without_names_the_executors_name_is_served():
    g = serving([])
    try:
        assert [m["id"] for m in httpx.get(g.url + "/v1/models").json()["data"]] == ["fake"]
        assert complete(g, "fake").json()["model"] == "fake"
        assert complete(g, "first").status_code == 404
    finally:
        g._call(g.http.stop())
        g.close()


def test_named_keeps_each_name_once_the_first_reported():
    info = ModelInfo("dir-name", 64, 10, [], None, "", KVGeometry(1, 1, 1, 4))
    assert named(info, []) is info and names_of(info) == ["dir-name"]
    twice = named(info, ["a", "b", "a", "b", "c"])
    assert (twice.name, twice.aliases, names_of(twice)) == ("a", ["b", "c"], ["a", "b", "c"])
    assert serves(twice, "c") and serves(twice, "") and serves(twice, None) and not serves(twice, "dir-name")
