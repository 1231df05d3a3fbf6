"""A hostile grammar through `pagedserve serve` (real processes, the zero-cost executor):
a guided_json pattern with a huge repetition count (its grammar takes ~25 s to build) gets a
400 naming --grammar-compile-timeout once that budget passes, /health answers 200 all the
while, and a well-behaved guided request is served after it. The /health latency itself is
measured in the branch's report, not asserted."""
import threading

import httpx

from tests.support.serve_procs import serving_http

HOSTILE = {"type": "string", "pattern": "^[a-z0-9 ]{1,16000}$"}
ASK = [{"role": "user", "content": "hi"}]


def test_health_answers_while_a_hostile_grammar_is_refused():
    with serving_http("--zero-cost", "--grammar-compile-timeout", "2") as serve:
        statuses, stop = [], threading.Event()

        def poll():
            with httpx.Client(timeout=30) as client:
                while not stop.is_set():
                    statuses.append(client.get(serve.url + "/health").status_code)
                    stop.wait(0.05)
        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        try:
            r = httpx.post(serve.url + "/v1/chat/completions", timeout=60,
                           json={"messages": ASK, "max_tokens": 4, "guided_json": HOSTILE})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == "guided_json" and "--grammar-compile-timeout" in error["message"]
            again = httpx.post(serve.url + "/v1/chat/completions", timeout=60,  # remembered: refused at once
                               json={"messages": ASK, "max_tokens": 4, "guided_json": HOSTILE})
            assert again.status_code == 400 and again.json()["error"]["message"] == error["message"]
            ok = httpx.post(serve.url + "/v1/chat/completions", timeout=60, json={
                "messages": ASK, "max_tokens": 4,
                "guided_json": {"type": "object", "properties": {"a": {"type": "integer"}}}})
            assert ok.status_code == 200, ok.text
        finally:
            stop.set()
            poller.join(35)
        assert statuses and set(statuses) == {200}
