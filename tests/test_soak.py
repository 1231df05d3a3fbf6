"""A bounded soak with real processes (memsvc, the model-free executor, a gateway with a
queue bound and a small pool): every request ends completed, cancelled, past its deadline
or refused for a full queue; no block stays referenced; the gateway and memsvc do not
grow between the first and the last quarter. SOAK_REQUESTS scales it (RELIABILITY.md)."""
import asyncio
import os

import pytest

from benchmarks.soak import CLEAR, SoakConfig, soak
from tests.reliability_procs import Stack, scrape

REQUESTS = int(os.environ.get("SOAK_REQUESTS", "2000"))
GROWTH_LIMIT = 24 << 20  # bytes of RSS between the first and the last quarter


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(str(tmp_path_factory.mktemp("soak")), kv_tokens=2048,
              gateway_args=["--max-num-seqs", "32", "--max-waiting", "28"])
    try:
        s.wait_serving()
        yield s
    finally:
        s.stop()


def test_soak_ends_clean(stack):
    pids = {"gateway": stack.procs["gateway"].pid, "memsvc": stack.procs["memsvc"].pid}
    cfg = SoakConfig(requests=REQUESTS, concurrency=64, max_prompt_words=120, max_tokens=64)
    report = asyncio.run(soak(stack.gateway, stack.memsvc, cfg, pids))
    print(report)
    outcomes = report["outcomes"]
    assert set(outcomes) <= CLEAR, report["unclear"]
    assert sum(outcomes.values()) == REQUESTS
    assert outcomes["completed"] > REQUESTS // 3
    assert outcomes.get("cancelled", 0) > 0 and outcomes.get("RESOURCE_EXHAUSTED", 0) > 0
    assert report["memsvc"]["blocks_referenced"] == 0 and report["memsvc"]["num_sequences"] == 0
    assert report["memsvc"]["num_preemptions"] > 0  # the pool was too small at times
    for name, quarters in report["rss_bytes_by_quarter"].items():
        assert quarters[-1] - quarters[0] < GROWTH_LIMIT, (name, quarters)
    m = scrape(stack.ports["gateway_metrics"])
    assert m["pagedserve:num_requests_running"] == m["pagedserve:num_requests_waiting"] == 0
    assert m['pagedserve:request_errors_total{code="RESOURCE_EXHAUSTED"}'] == outcomes["RESOURCE_EXHAUSTED"]
