"""The metrics under vLLM's names too (pagedserve.gateway.metrics_vllm): the gateway's own families
and memsvc's merged ones, with `model_name`, beside the `pagedserve:*` ones, equal to them."""
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.gateway.metrics import GatewayMetrics
from pagedserve.gateway.metrics_proxy import merge
from pagedserve.gateway.metrics_vllm import VLLM_NAMES
from tests.support import REPO

MODEL = 'model_name="org/m"'


def samples(text: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def gateway_metrics() -> GatewayMetrics:
    m = GatewayMetrics(CollectorRegistry())
    scheduler = SimpleNamespace(running=[SimpleNamespace(request_id="a"), SimpleNamespace(request_id="a")],
                                waiting=[SimpleNamespace(request_id="b"), SimpleNamespace(request_id="c")],
                                swapped=[])
    m.watch_scheduler(lambda: scheduler, "org/m")
    m.prompt_tokens.inc(7)
    m.generation_tokens.inc(3)
    m.ttft.observe(0.2)
    m.tpot.observe(0.01)
    m.success.labels("stop").inc()
    return m


def test_the_gateways_metrics_carry_vllms_names_and_the_model_name():
    m = samples(generate_latest(gateway_metrics().registry).decode())
    assert m[f"vllm:num_requests_running{{{MODEL}}}"] == m["pagedserve:num_requests_running"] == 1
    assert m[f"vllm:num_requests_waiting{{{MODEL}}}"] == m["pagedserve:num_requests_waiting"] == 2
    assert m[f"vllm:prompt_tokens_total{{{MODEL}}}"] == 7
    assert m[f"vllm:generation_tokens_total{{{MODEL}}}"] == 3
    assert m[f'vllm:request_success_total{{finished_reason="stop",{MODEL}}}'] == 1
    assert m[f"vllm:time_to_first_token_seconds_count{{{MODEL}}}"] == 1
    assert m[f"vllm:time_to_first_token_seconds_sum{{{MODEL}}}"] == m["pagedserve:time_to_first_token_seconds_sum"]
    for name in ("vllm:time_per_output_token_seconds", "vllm:request_time_per_output_token_seconds"):
        assert m[f'{name}_bucket{{le="+Inf",{MODEL}}}'] == 1


def test_nothing_under_vllms_names_before_the_model_is_known():
    text = generate_latest(GatewayMetrics(CollectorRegistry()).registry).decode()
    assert "pagedserve:num_requests_running" in text and "vllm:" not in text


def test_memsvcs_kv_cache_usage_merged_in_under_vllms_names():
    up = CollectorRegistry()
    Gauge("pagedserve:kv_cache_usage_perc", "kv", registry=up).set(0.25)
    upstream = list(text_string_to_metric_families(generate_latest(up).decode()))
    m = samples(merge([], {"memsvc": upstream}, "org/m").decode())
    for name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
        assert m[f'{name}{{{MODEL},service="memsvc"}}'] == 0.25
    assert m['pagedserve:kv_cache_usage_perc{service="memsvc"}'] == 0.25
    assert "vllm:" not in merge([], {"memsvc": upstream}).decode()


def test_every_mapped_family_exists():
    """Each pagedserve name VLLM_NAMES maps is exported by the gateway or memsvc."""
    source = generate_latest(gateway_metrics().registry).decode() + (REPO / "pagedserve" / "memsvc" / "metrics.py").read_text()
    for name in VLLM_NAMES:
        assert name in source, name
