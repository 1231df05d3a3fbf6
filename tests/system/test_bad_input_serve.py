"""`pagedserve serve` on the default model, as a user meets it: the request bodies that used to
poison the prefix cache or end every request in flight (issue 40) are refused with 400, the
next request on the same fresh prefix gives what a fresh computation gives, and a stream
running beside them gets all its tokens."""
import json
import threading
import uuid

import httpx
import pytest

from tests.support.serve_procs import serving_http

BAD = [  # each once beyond what the wire or the arithmetic can carry
    {"top_k": 2147483648},
    {"stop_token_ids": [1099511627776]},
    {"stop": ["\ud800"]},
    {"top_p": 1e-46, "logprobs": 2},
    {"temperature": 1e39},
    {"beam_width": 2, "length_penalty": 1000},
    {"beam_width": 2, "length_penalty": -1000},
]


@pytest.fixture(scope="module")
def served():
    with serving_http("--kv-tokens", "8192", "--max-num-seqs", "8") as serve:
        yield serve


def post(url, body, timeout=120):
    """POST raw JSON (ensure_ascii: a lone surrogate travels as its escape)."""
    return httpx.post(f"{url}/v1/completions", content=json.dumps(body).encode(),
                      headers={"Content-Type": "application/json"}, timeout=timeout)


def greedy(prompt, max_tokens=12, **extra):
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}


@pytest.mark.parametrize("bad", BAD, ids=lambda b: ",".join(b))
def test_bad_parameters_are_400_and_leave_the_prefix_cache_clean(served, bad):
    prefix = f"Session {uuid.uuid4().hex}: " + "The quick brown fox jumps over the lazy dog. " * 8
    r = post(served.url, greedy(prefix + "Then", **bad))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"], r.text
    after = post(served.url, greedy(prefix + "Then"))
    fresh = post(served.url, greedy(prefix + "Then", cache_salt=uuid.uuid4().hex))
    assert after.status_code == fresh.status_code == 200
    assert after.json()["choices"][0]["text"] == fresh.json()["choices"][0]["text"]


def test_a_stream_running_beside_bad_requests_gets_every_token(served):
    got = {}

    def stream():
        with httpx.stream("POST", f"{served.url}/v1/completions", timeout=300, json=greedy(
                "Write a long story about a lighthouse keeper.", 120, stream=True, ignore_eos=True)) as r:
            got["status"] = r.status_code
            got["lines"] = [line for line in r.iter_lines() if line.startswith("data: ")]
    t = threading.Thread(target=stream)
    t.start()
    statuses = [post(served.url, greedy("Hello there", **bad)).status_code for bad in BAD]
    t.join(300)
    assert statuses == [400] * len(BAD)
    assert got["status"] == 200 and got["lines"][-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in got["lines"][:-1]]
    assert not any("error" in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
