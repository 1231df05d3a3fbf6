"""`pagedserve serve` with no extra flag, through the unmodified `openai` client and curl-like
GETs: /metrics on the API port shows the whole replica (the gateway's request metrics and
memsvc's KV usage, the executor's steps), and the OpenAI extras work on the default model."""
import time
from types import SimpleNamespace

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.serve_procs import serving_http

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def served():
    with serving_http("--kv-tokens", "4096", "--max-num-seqs", "8") as serve:
        yield SimpleNamespace(url=serve.url, client=openai.OpenAI(base_url=serve.url + "/v1", api_key="none",
                                                                  max_retries=0, timeout=300))


def scrape(url: str) -> dict:
    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def test_metrics_on_the_api_port_show_the_whole_replica(served):
    served.client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4,
                                     temperature=0)
    time.sleep(0.2)
    m = scrape(served.url)
    assert m["pagedserve:time_to_first_token_seconds_count"] >= 1
    assert "pagedserve:time_to_first_token_seconds_bucket{le=\"0.1\"}" in m
    assert m["pagedserve:num_requests_running"] == 0 and m["pagedserve:num_requests_waiting"] == 0
    assert 'pagedserve:kv_cache_usage_perc{service="memsvc"}' in m
    assert m['pagedserve:metrics_upstream_up{service="memsvc"}'] == 1
    assert m['pagedserve:metrics_upstream_up{service="executor"}'] == 1
    assert m['pagedserve:execute_steps_total{service="executor"}'] >= 4


SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "population": {"type": "integer", "minimum": 0, "maximum": 99999999}},
          "required": ["city", "population"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_and_tool_calls_on_the_default_model(served, stream):
    import json

    import jsonschema

    kw = dict(model=MODEL, max_tokens=100, temperature=0, messages=[{"role": "user", "content": "Paris as JSON"}],
              response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA,
                                                                      "strict": True}})
    if stream:
        chunks = [c for c in served.client.chat.completions.create(stream=True, **kw) if c.choices]
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        reason = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason][-1]
    else:
        r = served.client.chat.completions.create(**kw)
        text, reason = r.choices[0].message.content, r.choices[0].finish_reason
    assert reason == "stop", text  # the output closes within max_tokens (bounded, steered to close)
    jsonschema.validate(json.loads(text), SCHEMA)
    kw = dict(model=MODEL, max_tokens=60, temperature=0, tools=[WEATHER], tool_choice="required",
              messages=[{"role": "user", "content": "Weather in Paris?"}])
    if stream:
        chunks = list(served.client.chat.completions.create(stream=True, **kw))
        calls = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
        reason = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason][-1]
    else:
        r = served.client.chat.completions.create(**kw)
        calls, reason = r.choices[0].message.tool_calls, r.choices[0].finish_reason
    assert reason == "tool_calls", calls  # not "length": the calls' JSON closes within max_tokens
    if stream:  # a call streams as vLLM streams it: its name first, then its arguments in pieces
        assert calls[0].function.name == "get_weather" and calls[0].function.arguments == ""
        arguments = "".join(t.function.arguments or "" for t in calls if t.index == calls[0].index)
    else:
        assert calls[0].function.name == "get_weather"
        arguments = calls[0].function.arguments
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])
