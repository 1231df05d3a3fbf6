"""`pagedserve serve ORG/NAME` offline (HF_HUB_OFFLINE=1): a tiny random model written into
a Hugging Face hub cache's layout is served by its hub id, through the real command and its
three processes; it answers as transformers' own greedy decoding of that model does, and
/metrics carries vLLM's names labelled with the id."""
import httpx
import pytest
import torch

from tests.support.hub_cache import write_snapshot
from tests.support.serve_procs import serving_http
from tests.support.tiny_models import make_tiny_model

REPO_ID = "tiny-org/tiny-llama"


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    path = write_snapshot(cache, REPO_ID, arch="llama3")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return path


def test_serve_a_hub_id_offline_from_the_cache(offline_cache, tmp_path):
    reference = make_tiny_model(tmp_path / "same", "llama3")  # the same seed: the same weights
    prompt = [5, 6, 7, 8]
    with torch.no_grad():
        out = reference.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                                 min_new_tokens=6, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    with serving_http(REPO_ID, "--kv-tokens", "1024", "--max-num-seqs", "4") as serve:
        models = httpx.get(serve.url + "/v1/models", timeout=30).json()
        assert [m["id"] for m in models["data"]] == [REPO_ID]
        r = httpx.post(serve.url + "/v1/completions", timeout=120, json={
            "model": REPO_ID, "prompt": " ".join(f"w{i}" for i in prompt), "max_tokens": 6,
            "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        # w0 (unknown) and w1 (end of sequence) are special tokens: left out of the text
        assert r.json()["choices"][0]["text"].split() == [f"w{i}" for i in out if i > 1]
        metrics = httpx.get(serve.url + "/metrics", timeout=30).text
    label = f'model_name="{REPO_ID}"'
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_count"):
        assert any(line.startswith(name + "{") and label in line for line in metrics.splitlines()), name


def test_served_model_names_reach_both_apis_through_serve(offline_cache):
    """`--served-model-name mine also`, as vLLM's: the gateway child serves both, reports the
    first, lists both, and answers another name (the hub id too) with a 404 naming them."""
    import grpc

    from pagedserve.wire.v1 import generation_pb2 as pb
    from pagedserve.wire.v1 import generation_pb2_grpc as pb_grpc

    with serving_http(REPO_ID, "--kv-tokens", "1024", "--served-model-name", "mine", "also") as serve:
        assert [m["id"] for m in httpx.get(serve.url + "/v1/models", timeout=30).json()["data"]] == ["mine", "also"]
        ask = {"prompt": [5, 6], "max_tokens": 2, "temperature": 0}
        r = httpx.post(serve.url + "/v1/completions", timeout=120, json={**ask, "model": "also"})
        assert r.status_code == 200 and r.json()["model"] == "mine", r.text
        r = httpx.post(serve.url + "/v1/completions", timeout=120, json={**ask, "model": REPO_ID})
        assert r.status_code == 404 and "`mine`, `also`" in r.json()["error"]["message"]
        with grpc.insecure_channel(f"127.0.0.1:{serve.port}") as channel:
            models = pb_grpc.GenerationStub(channel).ListModels(pb.ListModelsRequest(), timeout=30).models
        assert [m.name for m in models] == ["mine", "also"]
