"""The OpenAI HTTP API's extras over the in-process gateway (model-free executor, the default
model's tokenizer): /metrics on the API port (with upstreams merged), the body limit,
/tokenize and /detokenize, echo, priority and cache_salt."""
import httpx
import pytest
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.gateway.metrics_proxy import ReplicaMetrics, merge
from pagedserve.gateway.openai.server import start_openai
from tests.support.openai_server import Server


def samples(text: str) -> dict:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def test_metrics_on_the_api_port_without_a_key(tokenizer):
    s = Server(tokenizer, api_key="k")
    try:
        s.g.wait_ready()
        s.client.completions.create(model="fake", prompt="Hello there", max_tokens=3)
        r = httpx.get(s.url + "/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        m = samples(r.text)
        assert m["pagedserve:time_to_first_token_seconds_count"] >= 1
        assert "pagedserve:num_requests_running" in m and "pagedserve:num_requests_waiting" in m
    finally:
        s.close()


def test_upstream_metrics_are_merged_and_labelled():
    own = CollectorRegistry()
    Gauge("pagedserve:x", "x", registry=own).set(1)
    Gauge("process_open_fds", "fds", registry=own).set(3)
    up = CollectorRegistry()
    Gauge("pagedserve:kv_cache_usage_perc", "kv", registry=up).set(0.25)
    Gauge("process_open_fds", "fds", registry=up).set(7)
    upstream = list(text_string_to_metric_families(generate_latest(up).decode()))
    text = merge(list(own.collect()), {"memsvc": upstream, "executor": None}).decode()
    m = samples(text)
    assert m['pagedserve:kv_cache_usage_perc{service="memsvc"}'] == 0.25
    assert m["process_open_fds"] == 3 and m['process_open_fds{service="memsvc"}'] == 7
    assert m['pagedserve:metrics_upstream_up{service="memsvc"}'] == 1
    assert m['pagedserve:metrics_upstream_up{service="executor"}'] == 0
    assert text.count("# TYPE process_open_fds") == 1


def test_replica_metrics_fetches_an_upstream_over_http(server):
    import asyncio

    rm = ReplicaMetrics(CollectorRegistry(), [("gw", server.url + "/metrics"), ("gone", "http://127.0.0.1:9/m")],
                        timeout_s=2)
    m = samples(asyncio.run(rm.render()).decode())
    assert m['pagedserve:metrics_upstream_up{service="gw"}'] == 1
    assert m['pagedserve:metrics_upstream_up{service="gone"}'] == 0
    assert 'pagedserve:num_requests_running{service="gw"}' in m


def test_a_body_over_the_limit_is_413(server):
    http = server.g._call(start_openai(server.g.gateway, "127.0.0.1", 0, max_body_bytes=2048))
    try:
        url = f"http://127.0.0.1:{http.port}"
        r = httpx.post(url + "/v1/completions", json={"prompt": "x" * 4096, "max_tokens": 1}, timeout=30)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        def chunks():  # no Content-Length: counted while reading
            for _ in range(8):
                yield b"x" * 1024

        r = httpx.post(url + "/v1/completions", content=chunks(), timeout=30)
        assert r.status_code == 413
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=30)
        assert r.status_code == 200
    finally:
        server.g._call(http.stop())


def test_tokenize_and_detokenize_match_what_the_apis_use(server, tokenizer):
    r = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world"}).json()
    assert r["tokens"] == tokenizer.encode("Hello world", add_special_tokens=False)
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 2048
    chat = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    c = server.client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=1)
    assert chat["count"] == c.usage.prompt_tokens
    back = httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}).json()
    assert back == {"prompt": "Hello world"}
    assert httpx.post(server.url + "/detokenize", json={"tokens": [-1]}).status_code == 400
    assert httpx.post(server.url + "/tokenize", json={"prompt": "x", "model": "other"}).status_code == 404


def test_echo_prepends_the_prompt_streaming_or_not(server):
    plain = server.client.completions.create(model="fake", prompt="Once upon", max_tokens=4, seed=3)
    echoed = server.client.completions.create(model="fake", prompt="Once upon", max_tokens=4, seed=3,
                                              echo=True)
    assert echoed.choices[0].text == "Once upon" + plain.choices[0].text
    chunks = server.client.completions.create(model="fake", prompt="Once upon", max_tokens=4, seed=3,
                                              echo=True, stream=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == echoed.choices[0].text
    r = server.post("/v1/completions", {"prompt": "Hi", "echo": True, "beam_width": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"


def test_cache_salt_isolates_the_prefix_cache_on_both_apis(server):
    from pagedserve.wire.v1 import generation_pb2 as pb

    prompt = "A paged KV cache keeps each sequence in fixed-size blocks of tokens " * 3

    def cached(salt=None):
        extra = {"cache_salt": salt} if salt is not None else {}
        r = server.client.completions.create(model="fake", prompt=prompt, max_tokens=1, extra_body=extra)
        return r.usage.prompt_tokens_details.cached_tokens

    cached("tenant-a")
    assert cached("tenant-a") > 0
    assert cached("tenant-b") == 0
    assert cached() == 0 or cached() > 0  # unsalted: its own namespace
    stream = server.g.stub.Generate(pb.GenerateRequest(prompt=prompt, cache_salt="tenant-c",
                                                       sampling=pb.SamplingParams(max_tokens=1)), timeout=30)
    assert [r.usage.cached_tokens for r in stream][-1] == 0
    stream = server.g.stub.Generate(pb.GenerateRequest(prompt=prompt, cache_salt="tenant-a",
                                                       sampling=pb.SamplingParams(max_tokens=1)), timeout=30)
    assert [r.usage.cached_tokens for r in stream][-1] > 0


def test_priority_orders_the_waiting_queue(tokenizer):
    import threading
    import time

    s = Server(tokenizer, delay=0.01, max_num_seqs=1)
    try:
        s.g.wait_ready()
        done = []

        def run(name, priority, max_tokens):
            s.client.completions.create(model="fake", prompt=name, max_tokens=max_tokens,
                                        extra_body={"priority": priority, "ignore_eos": True})
            done.append(name)

        first = threading.Thread(target=run, args=("first", 0, 30))
        first.start()
        deadline = time.monotonic() + 10
        while not s.g.runner.loop.scheduler.running and time.monotonic() < deadline:
            time.sleep(0.005)
        low = threading.Thread(target=run, args=("low", 5, 2))
        low.start()
        while not s.g.runner.loop.scheduler.waiting and time.monotonic() < deadline:
            time.sleep(0.005)
        high = threading.Thread(target=run, args=("high", -1, 2))
        high.start()
        for t in (first, low, high):
            t.join(30)
        assert done.index("high") < done.index("low")
    finally:
        s.close()


def test_https_with_the_grpc_tls_flags(server, tmp_path):
    from tests.support.certs import make_cert_dir
    from pagedserve.rpc.tls import TlsConfig

    import ssl

    certs = make_cert_dir(tmp_path, {"gateway": ("gateway",)})
    ctx = ssl.create_default_context(cafile=certs["ca"])
    cert, key = certs["gateway"]
    http = server.g._call(start_openai(server.g.gateway, "127.0.0.1", 0, tls=TlsConfig(cert=cert, key=key)))
    try:
        url = f"https://127.0.0.1:{http.port}"
        assert httpx.get(url + "/health", verify=ctx).json() == {"status": "ok"}
        with pytest.raises(httpx.HTTPError):  # plaintext on the TLS port
            httpx.get(f"http://127.0.0.1:{http.port}/health", timeout=5)
        import openai

        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                               http_client=httpx.Client(verify=ctx))
        assert client.completions.create(model="fake", prompt="Hi", max_tokens=2).choices[0].text is not None
    finally:
        server.g._call(http.stop())
