"""pagedserve.gateway.grammar_budget and structured.prepare under it: a spec over the size budget, or
whose check and compile overrun the time budget, is a ValueError naming the budget and its
flag, raised at the deadline while the work keeps its worker; at most --grammar-workers run;
verdicts are remembered, an overrun included."""
import json
import threading

import pytest

from pagedserve.gateway import grammar_budget, structured
from pagedserve.gateway.grammar_budget import GrammarBudget, GrammarBudgetExceeded, GrammarBusy, GrammarChecks
from tests.support.grammar_budget import budget  # noqa: F401 (the fixture)


@pytest.fixture
def held():
    """A work that blocks until the test releases it, and the specs it was called with."""
    release, calls = threading.Event(), []

    def work(kind, spec):
        calls.append(spec)
        release.wait(30)
        return spec.upper()
    yield work, calls, release
    release.set()


def test_a_spec_over_the_size_budget_is_refused_at_once():
    checks = GrammarChecks(GrammarBudget(grammar_max_bytes=16))
    calls = []
    with pytest.raises(GrammarBudgetExceeded, match="--grammar-max-bytes") as e:
        checks.run("regex", "a" * 17, lambda kind, spec: calls.append(spec))
    assert "17 bytes" in str(e.value) and not calls
    assert checks.run("regex", "a" * 16, lambda kind, spec: spec) == "a" * 16


def test_an_overrun_is_refused_at_the_deadline_and_then_at_once(held):
    work, calls, release = held
    checks = GrammarChecks(GrammarBudget(grammar_compile_timeout=0.1))
    with pytest.raises(GrammarBudgetExceeded, match="--grammar-compile-timeout"):
        checks.run("regex", "slow", work)
    assert not release.is_set() and calls == ["slow"]  # refused while the work still runs
    with pytest.raises(GrammarBudgetExceeded, match="--grammar-compile-timeout"):
        checks.run("regex", "slow", work)  # remembered: not run again
    assert calls == ["slow"]


def test_at_most_the_workers_run_and_a_request_that_gets_none_is_told(held):
    work, calls, release = held
    checks = GrammarChecks(GrammarBudget(grammar_compile_timeout=0.1, grammar_workers=1))
    with pytest.raises(GrammarBudgetExceeded):
        checks.run("regex", "first", work)
    with pytest.raises(GrammarBusy, match="--grammar-workers") as e:
        checks.run("regex", "second", work)  # the one worker still holds the first
    assert "1 (--grammar-workers)" in str(e.value)
    release.set()
    checks._pool.shutdown(wait=True)
    assert calls == ["first"]  # the second never ran: dropped at its deadline


def test_verdicts_are_remembered():
    checks = GrammarChecks()
    calls = []

    def work(kind, spec):
        calls.append(spec)
        if spec == "bad":
            raise ValueError("bad spec")
        return spec + "!"
    assert [checks.run("regex", "ok", work) for _ in range(3)] == ["ok!"] * 3
    for _ in range(2):
        with pytest.raises(ValueError, match="bad spec"):
            checks.run("regex", "bad", work)
    assert calls == ["ok", "bad"]
    assert checks.run("grammar", "ok", work) == "ok!" and calls[-1] == "ok"  # the kind is in the key


def test_the_verdicts_are_bounded(monkeypatch):
    monkeypatch.setattr(grammar_budget, "MAX_VERDICTS", 3)
    checks = GrammarChecks()
    for k in range(5):
        checks.run("regex", str(k), lambda kind, spec: spec)
    assert len(checks._verdicts) == 3


HOSTILE = {"type": "string", "pattern": "^[a-z0-9 ]{1,4000}$"}  # about a second to build, on one core


def test_a_hostile_schema_is_a_400_naming_the_budget(budget):
    budget(grammar_compile_timeout=0.2)
    with pytest.raises(structured.GuidedError) as e:
        structured.from_openai({"guided_json": HOSTILE})
    assert e.value.param == "guided_json" and "--grammar-compile-timeout" in str(e.value)
    budget(grammar_max_bytes=64)
    with pytest.raises(ValueError, match="--grammar-max-bytes"):
        structured.prepare("json_schema", json.dumps({"type": "string", "enum": ["x" * 80]}))
    budget()
    assert structured.prepare("regex", "[a-z]{1,8}") == "[a-z]{1,8}"


@pytest.mark.parametrize("schema", [
    {"oneOf": [{"type": "object", "properties": {"k": {"const": i}}, "required": ["k"]} for i in range(1500)]},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa!"],
     "patternProperties": {"^(a+)+$": {"type": "string"}}},
])
def test_schema_checks_run_no_client_regex_and_nothing_quadratic(schema):
    """Disjoint oneOf branches (pairwise checks: quadratic) and a required name beside
    patternProperties (matching a client's regex: exponential in Python's re, holding the
    GIL) are decided without either."""
    if "oneOf" in schema:
        json.loads(structured.prepare("json_schema", json.dumps(schema)))
    else:
        with pytest.raises(ValueError, match="patternProperties"):
            structured.prepare("json_schema", json.dumps(schema))


def test_a_request_that_finds_every_worker_taken_is_told_to_retry(monkeypatch):
    from pagedserve.gateway import api_request, structured
    from pagedserve.gateway.openai import request as openai_request
    from pagedserve.wire.v1 import generation_pb2 as pb

    def taken(kind, spec):
        raise GrammarBusy("no grammar worker was free: 1 (--grammar-workers)")
    monkeypatch.setattr(structured, "prepare", taken)
    with pytest.raises(openai_request.OpenAIError) as e:
        openai_request._guided({"guided_regex": "a+"}, openai_request.SamplingParams())
    assert e.value.status == 429 and "--grammar-workers" in e.value.message
    with pytest.raises(api_request.ApiError) as e:
        api_request.sampling_from_proto(pb.SamplingParams(guided_kind="regex", guided_spec="a+"))
    assert e.value.code.name == "RESOURCE_EXHAUSTED"
