"""pagedserve.executor.logits_mask: xgrammar masks over random logits keep any sampler inside the grammar
(JSON schema, regex, choice, EBNF); the state is replayed from the output tokens, so a
recomputed or forked sequence continues where its tokens say."""
import json

import jsonschema
import numpy as np
import pytest
import torch

from pagedserve.executor.logits_mask import GuidedDecoding
from pagedserve.step.step_batch import StepBatch
from pagedserve.step.whole_seqs import Seq, batch_of
from pagedserve.wire.protocol import SamplingParams

BS = 16

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def guided(default_model_dir):
    from pagedserve.gateway.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model_dir)
    return GuidedDecoding(default_model_dir, 49152, [tok.eos_token_id], tokenizer=tok), tok


def seq(seq_id, sampling, output=(), sample=True, prompt=(1,)) -> Seq:
    """A sequence whose step computes its last token so far: the grammar's state is its output."""
    so_far = list(prompt) + list(output)
    return Seq(seq_id, so_far[-1:], len(so_far) - 1, [0] * -(-len(so_far) // BS), sample, sampling, 0,
               list(prompt), list(output))


def batch(*seqs: Seq) -> tuple[StepBatch, np.ndarray]:
    """The batch and its sampled rows, as the model runner hands them to prepare."""
    b = batch_of(list(seqs), BS)
    return b, np.flatnonzero(b.sample)


def decode(guided, kind, spec, seq_id="s", steps=80, seed=0, outputs=None, max_tokens=80):
    g, tok = guided
    gen = torch.Generator().manual_seed(seed)
    sp = SamplingParams(max_tokens=max_tokens, guided_kind=kind, guided_spec=spec)
    out = list(outputs or [])
    for _ in range(steps):
        logits = torch.randn(1, 49152, generator=gen)
        g.apply(logits, g.prepare(*batch(seq(seq_id, sp, out))))
        t = int(logits.argmax(-1))
        if t == tok.eos_token_id:
            break
        out.append(t)
    return out, tok.decode(out)


def test_json_schema_output_is_valid_from_random_logits(guided):
    _, text = decode(guided, "json_schema", json.dumps(SCHEMA))
    jsonschema.validate(json.loads(text), SCHEMA)


def test_regex_choice_and_ebnf(guided):
    import re

    assert re.fullmatch(r"\d{3}-\d{4}", decode(guided, "regex", r"\d{3}-\d{4}")[1])
    assert decode(guided, "choice", json.dumps(["yes", "no", "maybe"]), seed=3)[1] in ("yes", "no", "maybe")
    text = decode(guided, "grammar", 'root ::= "(" [0-9]+ ("+" [0-9]+)* ")"')[1]
    assert re.fullmatch(r"\(\d+(\+\d+)*\)", text)


def test_state_is_replayed_from_the_outputs(guided):
    spec = json.dumps(SCHEMA)
    tokens, _ = decode(guided, "json_schema", spec, seq_id="a")
    half = tokens[: len(tokens) // 2]
    # another id with the first half (a fork, or a recompute after the cache was dropped)
    rest, text = decode(guided, "json_schema", spec, seq_id="b", outputs=half, seed=5)
    jsonschema.validate(json.loads(text), SCHEMA)
    assert rest[: len(half)] == half
    # the same id going back to a shorter history (preempted, recomputed) replays too
    again, text = decode(guided, "json_schema", spec, seq_id="a", outputs=half, seed=9)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_unguided_rows_are_untouched(guided):
    g, _ = guided
    plain = seq("p", SamplingParams())
    assert g.prepare(*batch(plain)) is None
    logits = torch.randn(2, 49152)
    before = logits.clone()
    steered = seq("q", SamplingParams(guided_kind="regex", guided_spec="a+"))
    g.apply(logits, g.prepare(*batch(plain, steered)))
    assert torch.equal(logits[0], before[0]) and torch.isinf(logits[1]).sum() > 40000


def test_forget_drops_the_matchers_of_finished_sequences(guided):
    g, _ = guided
    spec = json.dumps(SCHEMA)
    decode(guided, "json_schema", spec, seq_id="a")
    decode(guided, "json_schema", spec, seq_id="b")
    owners = lambda: {k.split("\0", 1)[0] for k in g._matchers}
    assert owners() >= {"a", "b"}
    g.forget(["a"])
    assert "a" not in owners() and "b" in owners()


def test_closing_tokens_are_the_closers_and_the_stop_token(guided):
    g, tok = guided
    g.compiler()
    def bits(t, in_string=False):
        return bool((int(g._closing[in_string][t // 32]) >> (t % 32)) & 1)

    ids = {p: tok.convert_tokens_to_ids(p) for p in ('}', '"]', '"}', ']', '"', "a", "{", ",", "1", ":")}
    assert all(bits(ids[p]) for p in ('}', '"]', '"}', ']', '"')) and bits(tok.eos_token_id)
    assert not any(bits(ids[p]) for p in ("a", "{", ",", "1", ":"))
    # in a string, `]` and `}` are content: only what begins with the closing quote closes
    assert all(bits(ids[p], True) for p in ('"]', '"}', '"')) and not bits(ids["]"], True)


TAGS = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["tags"], "additionalProperties": False}
NESTED = {"type": "object", "properties": {"_": {"$ref": "#"}, "n": {"type": "array", "items": {"$ref": "#"}}},
          "additionalProperties": False}


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("schema", [TAGS, NESTED], ids=["array", "nested"])
def test_an_open_output_closes_within_max_tokens(guided, seed, schema):
    """An array of strings, or objects nested without end, have no end of their own; from
    random logits they close (valid) within max_tokens because the last tokens (at least as
    many as the open levels) prefer the closing ones."""
    tokens, text = decode(guided, "json_schema", json.dumps(schema), seq_id=f"c{seed}{len(str(schema))}",
                          steps=41, seed=seed, max_tokens=40)
    assert len(tokens) <= 40, text
    jsonschema.validate(json.loads(text), schema)


def test_the_closing_window_covers_the_open_levels():
    from pagedserve.executor.logits_mask import CLOSE_MARGIN, CLOSE_WITHIN, close_window

    assert close_window(16) == 4 and close_window(1000) == CLOSE_WITHIN
    assert close_window(300, depth=100) == 100 + CLOSE_MARGIN  # deep output: one token per level at least


class Gate:
    """A compiler whose compile of `held` waits until the gate opens."""

    def __init__(self, compiler, held: str):
        import threading

        self.compiler, self.held, self.open = compiler, held, threading.Event()

    def __getattr__(self, name):
        return getattr(self.compiler, name)

    def compile_grammar(self, spec):
        if spec == self.held:
            assert self.open.wait(30)
        return self.compiler.compile_grammar(spec)


def test_grammars_compile_from_first_sight_and_hold_only_their_own_masks(default_model_dir):
    from pagedserve.gateway.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model_dir)
    g = GuidedDecoding(default_model_dir, 49152, [tok.eos_token_id], tokenizer=tok)
    held = 'root ::= "yes" | "no"'
    gate = Gate(g.compiler(), held)
    g.grammars.compiler = lambda: gate
    sp = SamplingParams(max_tokens=8, guided_kind="grammar", guided_spec=held)
    chunk = seq("h", sp, sample=False)  # a prompt chunk: samples nothing
    g.expect(batch(chunk)[0])  # returns while its grammar compiles (held)
    compiling = g.grammars.compiled("grammar", held)
    assert not compiling.done()
    import re

    assert re.fullmatch(r"\d{3}-\d{4}", decode((g, tok), "regex", r"\d{3}-\d{4}")[1])  # others go on
    pending = g.prepare(*batch(seq("h", sp)))
    assert not pending.done()  # its own mask waits for its grammar
    gate.open.set()
    logits = torch.randn(1, 49152)
    g.apply(logits, pending)
    allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    assert allowed and all(tok.decode([t]) in ("y", "ye", "yes", "n", "no") for t in allowed)


def test_compiled_grammars_are_kept_within_their_byte_budget(default_model_dir):
    from pagedserve.gateway.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model_dir)
    g = GuidedDecoding(default_model_dir, 49152, [tok.eos_token_id], tokenizer=tok)
    specs = [json.dumps({"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"],
                         "additionalProperties": False}) for i in range(5)]
    g.grammar("json_schema", specs[0])
    one = g.grammars.kept_bytes
    assert one > len(specs[0])  # xgrammar's size of the compiled grammar counts
    g.grammars.cache_bytes = int(one * 2.5)
    for spec in specs[1:]:
        g.grammar("json_schema", spec)
    assert g.grammars.kept_bytes <= g.grammars.cache_bytes
    assert g.grammars.kept() == [("json_schema", s) for s in specs[3:]]  # least recently used out
    _, text = decode((g, tok), "json_schema", specs[0], seq_id="again")  # dropped: compiled again
    assert json.loads(text).keys() == {"k0"}
    g.grammars.cache_bytes = 0
    g.grammar("json_schema", specs[1])
    assert g.grammars.kept() == [] and g.grammars.kept_bytes == 0


def test_mask_rows_follow_the_sampled_rows_of_a_batch(guided):
    """Logits row k is batch row rows[k]: a prompt chunk before it takes no logits row."""
    g, _ = guided
    sp = SamplingParams(guided_kind="regex", guided_spec="a+")
    b, rows = batch(seq("chunk", sp, sample=False), seq("p", SamplingParams()), seq("q", sp))
    assert rows.tolist() == [1, 2]
    logits = torch.randn(2, 49152)
    before = logits.clone()
    assert g.apply(logits, g.prepare(b, rows)) == {}
    assert torch.equal(logits[0], before[0]) and torch.isinf(logits[1]).sum() > 40000
