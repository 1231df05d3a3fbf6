"""A bounded, seeded run of the fuzzer (pagedserve.benchmarks.fuzz_harness, `pagedserve bench fuzz`)
against a real `pagedserve serve` on the default model: FUZZ_REQUESTS (default 300) hostile
requests over the OpenAI HTTP API and gRPC, with greedy reference requests beside them and
/health polled all along (RELIABILITY.md, "Fuzzing the running services"). FUZZ_SEED picks
the seed (default 0); the report is written to the test's temporary folder and its path
printed.

Invariants, one test each: no 5xx (nor unanswered request) for any input, reference
requests included; every reference answer equal to its fresh computation (the same
request with a new cache_salt); memsvc holds no block and no sequence after the run; every
/health poll answered 200. Nothing about time is asserted: /health latency is the bench's
to report.
"""
import json
import os

import pytest

from pagedserve.benchmarks.fuzz_harness import FuzzConfig, run
from tests.support.serve_procs import serving_http

REQUESTS = int(os.environ.get("FUZZ_REQUESTS", "300"))
SEED = int(os.environ.get("FUZZ_SEED", "0"))


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    with serving_http("--kv-tokens", "4096", "--max-num-seqs", "8") as serve:
        out = run(FuzzConfig(requests=REQUESTS, seed=SEED), serve.url, f"127.0.0.1:{serve.port}")
    path = tmp_path_factory.mktemp("fuzz") / "fuzz.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"\nfuzz report ({REQUESTS} requests, seed {SEED}): {path}\noutcomes: {out['outcomes']}")
    return out


def _show(items: list[dict], limit: int = 12) -> str:
    return "\n".join(json.dumps(x)[:700] for x in items[:limit])


def test_no_server_error_for_any_input(report):
    assert report["requests"] == REQUESTS
    refs = report["references"]
    failed_refs = [r for r in refs["errors"] if r["server_error"]]
    assert report["server_error_count"] == 0 and refs["server_error_count"] == 0, (
        f"{report['server_error_count']} fuzzed and {refs['server_error_count']} reference requests failed "
        f"by the server's fault; outcomes {report['outcomes']}\n{_show(report['server_errors'])}\n"
        f"references:\n{_show(failed_refs)}")


def test_every_reference_equals_its_fresh_computation(report):
    refs = report["references"]
    assert refs["compared"] > 0, refs
    assert refs["mismatch_count"] == 0, (
        f"{refs['mismatch_count']} of {refs['compared']} reference answers differ from a fresh computation "
        f"(a prefix-cache block left wrong):\n{_show(refs['mismatches'])}")


def test_nothing_held_after_the_run(report):
    after = report["after"]
    assert after["blocks_referenced"] == 0 and after["num_sequences"] == 0, after


def test_health_answered_every_poll(report):
    health = report["health"]
    assert health["polls"] > 0
    assert health["statuses"] == {"200": health["polls"]}, (
        f"{health['statuses']}:\n{_show([n for n in health['notable'] if n['status'] != 200])}")
