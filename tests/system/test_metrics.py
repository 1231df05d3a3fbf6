"""Prometheus /metrics on each service (real processes, the model-free executor): the names
vLLM users know, values that follow a request through, and no listener unless asked."""
import threading
import time
import urllib.request

import pytest

from pagedserve.wire.v1 import generation_pb2 as pb
from tests.support.gateway_harness import collect, greedy
from tests.support.reliability_procs import scrape, serving_stack

PROMPT = "A paged KV cache keeps each sequence in fixed-size blocks of tokens, so that " * 3


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with serving_stack(str(tmp_path_factory.mktemp("metrics")), kv_tokens=1024,
                       executor_args=["--step-delay", "0.05"]) as s:
        yield s


def test_each_service_serves_prometheus_text(stack):
    for name in ("gateway", "memsvc", "executor"):
        with urllib.request.urlopen(f"http://127.0.0.1:{stack.ports[name + '_metrics']}/metrics", timeout=5) as r:
            assert r.headers["Content-Type"].startswith("text/plain")
            text = r.read().decode()
        assert "process_resident_memory_bytes" in text and "# TYPE pagedserve:" in text


def test_metrics_follow_a_request(stack):
    gw, mem = stack.ports["gateway_metrics"], stack.ports["memsvc_metrics"]
    g0, m0 = scrape(gw), scrape(mem)
    assert m0["pagedserve:kv_cache_usage_perc"] == 0
    result = {}
    t = threading.Thread(target=lambda: result.update(collect(stack.gen.Generate(
        pb.GenerateRequest(prompt=PROMPT, sampling=greedy(30, ignore_eos=True)), timeout=60))))
    t.start()
    deadline = time.monotonic() + 20
    while scrape(gw)["pagedserve:num_requests_running"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    busy = scrape(mem)
    assert 0 < busy["pagedserve:kv_cache_usage_perc"] <= 1
    assert 0 < busy["pagedserve:token_state_fraction"] <= busy["pagedserve:kv_cache_usage_perc"]
    assert busy['pagedserve:kv_cache_blocks{state="referenced"}'] > 0 and busy["pagedserve:num_sequences"] == 1
    t.join(60)
    prompt_tokens = result[0]["usage"][0]
    time.sleep(0.3)
    g1, m1 = scrape(gw), scrape(mem)
    assert g1["pagedserve:num_requests_running"] == g1["pagedserve:num_requests_waiting"] == 0
    assert g1["pagedserve:num_requests_swapped"] == 0
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "time_per_output_token_seconds",
              "request_queue_time_seconds"):
        assert g1[f"pagedserve:{h}_count"] == g0[f"pagedserve:{h}_count"] + 1, h
    assert g1["pagedserve:prompt_tokens_total"] - g0["pagedserve:prompt_tokens_total"] == prompt_tokens
    assert g1["pagedserve:generation_tokens_total"] - g0["pagedserve:generation_tokens_total"] == 30
    assert g1['pagedserve:request_success_total{finished_reason="length"}'] >= 1
    assert 'pagedserve:num_preemptions_total{mode="recompute"}' in g1
    assert 'pagedserve:num_preemptions_total{mode="swap"}' in g1
    assert m1["pagedserve:kv_cache_usage_perc"] == 0
    assert m1["pagedserve:prefix_cache_queries_total"] - m0["pagedserve:prefix_cache_queries_total"] == prompt_tokens
    ex = scrape(stack.ports["executor_metrics"])
    assert ex["pagedserve:execute_steps_total"] >= 30 and ex["pagedserve:execute_seconds_count"] >= 30


def test_prefix_cache_hits_are_counted(stack):
    mem = stack.ports["memsvc_metrics"]
    before = scrape(mem)["pagedserve:prefix_cache_hits_total"]
    collect(stack.gen.Generate(pb.GenerateRequest(prompt=PROMPT, sampling=greedy(2)), timeout=60))
    assert scrape(mem)["pagedserve:prefix_cache_hits_total"] - before >= 16  # at least one full block


def test_no_metrics_listener_unless_asked():
    import argparse

    from pagedserve.service_cmds import SERVICES
    from pagedserve.wire.settings import add_flags

    for cls, _, _ in SERVICES.values():
        p = argparse.ArgumentParser()
        add_flags(p, cls)
        assert p.parse_args([]).metrics_port is None
