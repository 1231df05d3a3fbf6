"""A bounded soak with real processes (memsvc, the model-free executor, a gateway with a
queue bound and a small pool): every request ends completed, cancelled, past its deadline
or refused for a full queue; at least one completes; no block stays referenced and the
pool adds up; the gateway and memsvc do not grow between the first and the last quarter. SOAK_REQUESTS scales it (RELIABILITY.md)."""
import asyncio
import os

import pytest

from pagedserve.benchmarks.soak import CLEAR, SoakConfig, soak
from tests.support.reliability_procs import scrape, serving_stack

REQUESTS = int(os.environ.get("SOAK_REQUESTS", "2000"))
GROWTH_LIMIT = 24 << 20  # bytes of RSS between the first and the last quarter


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with serving_stack(str(tmp_path_factory.mktemp("soak")), kv_tokens=2048,
                       gateway_args=["--max-num-seqs", "32", "--max-waiting", "28"]) as s:
        yield s


def test_soak_ends_clean(stack):
    """Invariants only: how many requests complete, are cancelled or refused, and whether the
    pool ever ran short, depend on the machine's speed; how each request ends does not."""
    pids = {"gateway": stack.procs["gateway"].pid, "memsvc": stack.procs["memsvc"].pid}
    cfg = SoakConfig(requests=REQUESTS, concurrency=64, max_prompt_words=120, max_tokens=64)
    report = asyncio.run(soak(stack.gateway, stack.memsvc, cfg, pids, stack.token))
    print(report)
    outcomes = report["outcomes"]
    assert set(outcomes) <= CLEAR, report["unclear"]  # each ends with a clear status
    assert sum(outcomes.values()) == REQUESTS
    assert outcomes.get("completed", 0) >= 1, outcomes  # a broken system completes nothing
    # nothing leaked: no block referenced, no sequence left, and the pool adds up
    assert report["memsvc"]["blocks_referenced"] == 0 and report["memsvc"]["num_sequences"] == 0
    stats = stack.memsvc_stats()
    assert stats.blocks_referenced == 0 and stats.num_sequences == 0
    assert stats.blocks_free + stats.blocks_cached == stats.num_blocks, stats
    for name, quarters in report["rss_bytes_by_quarter"].items():  # memory flat
        assert quarters[-1] - quarters[0] < GROWTH_LIMIT, (name, quarters)
    m = scrape(stack.ports["gateway_metrics"])
    assert m["pagedserve:num_requests_running"] == m["pagedserve:num_requests_waiting"] == 0
    # the gateway counts every refusal a client saw; a client that gave up (cancel, deadline)
    # at the moment it was refused saw its own status instead
    refused = m.get('pagedserve:request_errors_total{code="RESOURCE_EXHAUSTED"}', 0)
    gave_up = outcomes.get("cancelled", 0) + outcomes.get("DEADLINE_EXCEEDED", 0)
    assert outcomes.get("RESOURCE_EXHAUSTED", 0) <= refused <= outcomes.get("RESOURCE_EXHAUSTED", 0) + gave_up
