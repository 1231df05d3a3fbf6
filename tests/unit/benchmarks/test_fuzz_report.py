"""`bench fuzz`'s bookkeeping, without a server: outcomes and references into a report, the
invariants a report breaks, memsvc's gauges read from a /metrics scrape, and a server
error inside a 200 event stream told apart from a client's error."""
from pagedserve.benchmarks.fuzz_probe import Outcome, Probe
from pagedserve.benchmarks.fuzz_reference import Reference
from pagedserve.benchmarks.fuzz_report import Recorder, violations
from pagedserve.benchmarks.fuzz_send import _event_error
from pagedserve.benchmarks.fuzz_watch import health_summary, memsvc_gauges

HEALTHY = {"polls": 3, "statuses": {"200": 3}, "p50_ms": 2.0, "p99_ms": 250.0, "max_ms": 250.0, "over_100ms": 1}
SETTLED = {"blocks_referenced": 0, "num_sequences": 0}


def _probe(i: int) -> Probe:
    return Probe(index=i, category="numbers", api="http", target="/v1/completions", body=b'{"top_k": 1}')


def test_a_clean_report_breaks_nothing_and_the_p99_only_when_bounded():
    rec = Recorder()
    rec.probe(_probe(0), Outcome("http 400", False))
    rec.reference(Reference("completions", "shared", "p", cached=" a", fresh=" a"))
    report = rec.report({}, 1.0, HEALTHY, SETTLED)
    assert report["outcomes"] == {"http 400": 1} and report["references"]["compared"] == 1
    assert violations(report) == []
    assert [v for v in violations(report, health_p99_ms=100) if "p99" in v]


def test_each_broken_invariant_is_named():
    rec = Recorder()
    rec.probe(_probe(0), Outcome("http 503", True, "backend failed"))
    rec.reference(Reference("chat", "fresh", "p", after="#0 numbers", cached=" x", fresh=" y"))
    rec.reference(Reference("generate", "shared", "p", errors=["as is: grpc UNAVAILABLE"], server_error=True))
    health = {**HEALTHY, "statuses": {"200": 2, "503": 1}}
    report = rec.report({}, 1.0, health, {"blocks_referenced": 6, "num_sequences": 1})
    assert report["server_errors"][0]["index"] == 0 and report["references"]["mismatches"][0]["fresh"] == " y"
    found = " | ".join(violations(report))
    for words in ("1 requests answered 5xx", "1 reference answers differ", "1 reference requests failed",
                  "holds 6 blocks", "/health answered other than 200"):
        assert words in found


def test_memsvc_gauges_are_read_from_the_replica_scrape():
    text = """# TYPE pagedserve:kv_cache_blocks gauge
pagedserve:kv_cache_blocks{service="memsvc",state="referenced"} 3.0
pagedserve:kv_cache_blocks{service="memsvc",state="free"} 250.0
# TYPE pagedserve:num_sequences gauge
pagedserve:num_sequences{service="memsvc"} 1.0
# TYPE pagedserve:num_requests_running gauge
pagedserve:num_requests_running 2.0
"""
    assert memsvc_gauges(text) == {"blocks_referenced": 3, "num_sequences": 1, "gateway_requests_running": 2}
    assert memsvc_gauges("")["blocks_referenced"] is None  # not scraped is not zero


def test_health_summary():
    s = health_summary([(0.0, 200, 0.002), (0.05, 200, 0.004), (0.1, None, 10.0)])
    assert s["polls"] == 3 and s["statuses"] == {"200": 2, "None": 1} and s["max_ms"] == 10000.0


def test_a_server_error_event_in_a_stream():
    assert _event_error('data: {"error": {"message": "backend failed", "type": "server_error"}}') == "backend failed"
    assert _event_error('data: {"error": {"message": "bad", "type": "invalid_request_error"}}') is None
    assert _event_error('data: {"choices": [{"text": "\\"error\\""}]}') is None
