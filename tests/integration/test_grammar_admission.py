"""The gateway's grammar check with the default model's tokenizer bound
(pagedserve.gateway.grammar_compile): a grammar is compiled at admission as the executor will compile
it, so one that parses at once but takes long to compile is refused within the budget
(pagedserve.gateway.grammar_budget), before it reaches a step."""
import json

import pytest

from pagedserve.gateway import grammar_compile, structured
from tests.support.grammar_budget import budget  # noqa: F401 (the fixture)

RULES = 3000  # parses in milliseconds; its token masks take 0.28 s on an AMD EPYC 26/2 (Zen 5), more on slower cores
SLOW_TO_COMPILE = "root ::= " + " | ".join(f"r{i}" for i in range(RULES)) + "\n" + "\n".join(
    f'r{i} ::= "a{i}" [a-z]* "b"' for i in range(RULES))


@pytest.fixture
def bound(default_model_dir):
    from pagedserve.gateway.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model_dir)
    grammar_compile.bind(tok, 49152, [tok.eos_token_id])
    yield
    grammar_compile.unbind()


def test_a_grammar_slow_to_compile_is_refused_only_once_compiled_with_the_tokenizer(budget, default_model_dir):
    budget(grammar_compile_timeout=0.3)
    assert structured.prepare("grammar", SLOW_TO_COMPILE) == SLOW_TO_COMPILE  # parsed only
    from pagedserve.gateway.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model_dir)
    grammar_compile.bind(tok, 49152, [tok.eos_token_id])
    try:
        budget(grammar_compile_timeout=0.05)  # new checks: nothing remembered; 0.3 s was within a fast core's compile
        with pytest.raises(structured.GuidedError) as e:
            structured.from_openai({"guided_grammar": SLOW_TO_COMPILE})
        assert e.value.param == "guided_grammar" and "--grammar-compile-timeout" in str(e.value)
    finally:
        grammar_compile.unbind()


def test_specs_compile_with_the_tokenizer_as_without(bound, budget):
    budget()
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    spec = structured.prepare("json_schema", json.dumps(schema))
    assert json.loads(spec)["properties"]["city"]["maxLength"] == 48
    assert structured.prepare("choice", json.dumps(["yes", "no"])) == '["yes", "no"]'
    assert structured.prepare("json_object", "") == ""
    with pytest.raises(ValueError):
        structured.prepare("regex", "(")
