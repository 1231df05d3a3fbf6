"""Compare grammar engines for structured outputs on a model's tokenizer: xgrammar,
llguidance, outlines-core. For each: compile time of a JSON schema, a regex and an EBNF
grammar (where supported), and the time to compute the next-token mask at each token of a
valid output (walked token by token, as decoding does). Coverage is what compiles.

    .venv/bin/python -m pagedserve.benchmarks.grammar_engines [--model DIR] [--repeat 3]

Prints one JSON line per engine. Not wired into `pagedserve bench` (a one-off choice).
"""
from __future__ import annotations

import argparse
import json
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "kind": {"enum": ["person", "company"]},
    },
    "required": ["name", "age", "email", "tags", "address", "kind"],
    "additionalProperties": False,
}
INSTANCE = ('{"name": "Ada Lovelace", "age": 36, "email": "ada@math.uk", "tags": ["math", "poetry"], '
            '"address": {"city": "London", "zip": "W1"}, "kind": "person"}')
REGEX = r"\d{3}-\d{3}-\d{4}"
REGEX_TEXT = "555-123-4567"
EBNF = 'root ::= "(" expr ")"\nexpr ::= term ("+" term)*\nterm ::= [0-9]+\n'
EBNF_TEXT = "(12+345+6)"


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


def _time(fn, repeat=1):
    best = float("inf")
    out = None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return out, best


def bench_xgrammar(tokenizer, vocab_size, repeat):
    import torch
    import xgrammar as xgr

    info, setup = _time(lambda: xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size))
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    out = {"engine": f"xgrammar {_version('xgrammar')}", "setup_s": setup}
    cases = {"json_schema": (lambda: compiler.compile_json_schema(json.dumps(SCHEMA)), INSTANCE),
             "regex": (lambda: compiler.compile_regex(REGEX), REGEX_TEXT),
             "ebnf": (lambda: compiler.compile_grammar(EBNF), EBNF_TEXT),
             "json_object": (lambda: compiler.compile_builtin_json_grammar(), INSTANCE)}
    for name, (compile_fn, text) in cases.items():
        try:
            grammar, secs = _time(compile_fn, repeat)
        except Exception as e:  # not covered
            out[name] = f"unsupported: {e}"[:80]
            continue
        ids = tokenizer.encode(text, add_special_tokens=False)
        mask = xgr.allocate_token_bitmask(1, info.vocab_size)
        m = xgr.GrammarMatcher(grammar)
        t = time.perf_counter()
        for tid in ids:
            m.fill_next_token_bitmask(mask)
            assert m.accept_token(tid), (name, tid)
        per = (time.perf_counter() - t) / len(ids)
        out[name] = {"compile_ms": secs * 1e3, "mask_us_per_token": per * 1e6, "tokens": len(ids)}
    del torch
    return out


def bench_llguidance(tokenizer, vocab_size, repeat):
    import llguidance
    import llguidance.hf
    import llguidance.torch

    lt, setup = _time(lambda: llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size))
    out = {"engine": f"llguidance {_version('llguidance')}", "setup_s": setup}
    cases = {"json_schema": (lambda: llguidance.LLMatcher.grammar_from_json_schema(SCHEMA), INSTANCE),
             "regex": (lambda: llguidance.LLMatcher.grammar_from_regex(REGEX), REGEX_TEXT),
             "ebnf": (lambda: llguidance.grammar_from("gbnf", EBNF.replace("::=", "::=")), EBNF_TEXT),
             "json_object": (lambda: llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}),
                             INSTANCE)}
    for name, (make, text) in cases.items():
        try:
            grammar = make()
            m, secs = _time(lambda: llguidance.LLMatcher(lt, grammar), repeat)
            if m.is_error():
                raise ValueError(m.get_error())
        except Exception as e:
            out[name] = f"unsupported: {e}"[:80]
            continue
        ids = tokenizer.encode(text, add_special_tokens=False)
        mask = llguidance.torch.allocate_token_bitmask(1, lt.vocab_size)
        t = time.perf_counter()
        for tid in ids:
            llguidance.torch.fill_next_token_bitmask(m, mask, 0)
            assert m.consume_token(tid), (name, tid, m.get_error())
        per = (time.perf_counter() - t) / len(ids)
        out[name] = {"compile_ms": secs * 1e3, "mask_us_per_token": per * 1e6, "tokens": len(ids)}
    return out


def bench_outlines(tokenizer, vocab_size, repeat, model_dir):
    import outlines_core
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    def vocab():
        # outlines-core builds its vocabulary from the Hugging Face hub name or tokenizer.json
        return Vocabulary.from_pretrained(model_dir)

    try:
        v, setup = _time(vocab)
        vocab_kind = "from_pretrained"
    except Exception:
        vocab_kind = "built from the tokenizer's tokens"
        toks = {}
        for tid in range(len(tokenizer)):
            s = tokenizer.convert_tokens_to_string([tokenizer.convert_ids_to_tokens(tid)])
            if tid in tokenizer.all_special_ids:
                continue
            toks.setdefault(s, []).append(tid)
        v, setup = _time(lambda: Vocabulary(tokenizer.eos_token_id, toks))
    out = {"engine": f"outlines-core {_version('outlines-core')}", "setup_s": setup,
           "vocabulary": vocab_kind}
    cases = {"json_schema": (lambda: build_regex_from_schema(json.dumps(SCHEMA)), INSTANCE),
             "regex": (lambda: REGEX, REGEX_TEXT), "ebnf": (None, EBNF_TEXT),
             "json_object": (lambda: build_regex_from_schema(json.dumps({"type": "object"})), INSTANCE)}
    for name, (make, text) in cases.items():
        if make is None:
            out[name] = "unsupported: no context-free grammars (regular languages only)"
            continue
        try:
            regex = make()
            index, secs = _time(lambda: Index(regex, v), repeat)
        except Exception as e:
            out[name] = f"unsupported: {e}"[:80]
            continue
        ids = tokenizer.encode(text, add_special_tokens=False)
        guide = Guide(index)
        t = time.perf_counter()
        for tid in ids:
            allowed = guide.get_tokens()
            assert tid in set(allowed), (name, tid, tokenizer.convert_ids_to_tokens(tid), regex[:200])
            guide.advance(tid)
        per = (time.perf_counter() - t) / len(ids)
        out[name] = {"compile_ms": secs * 1e3, "mask_us_per_token": per * 1e6, "tokens": len(ids)}
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a hub id, model directory or .gguf file (default: the default model)")
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args(argv)
    from pagedserve.executor.model_source import default_model_dir, resolve_model
    from pagedserve.gateway.tokenizer import load_tokenizer

    model_dir = resolve_model(args.model) if args.model else default_model_dir(progress=False)
    tokenizer = load_tokenizer(model_dir)
    vocab_size = len(tokenizer)
    for fn in (lambda: bench_xgrammar(tokenizer, vocab_size, args.repeat),
               lambda: bench_llguidance(tokenizer, vocab_size, args.repeat),
               lambda: bench_outlines(tokenizer, vocab_size, args.repeat, model_dir)):
        try:
            print(json.dumps(fn()), flush=True)
        except Exception as e:
            print(json.dumps({"error": repr(e)[:300]}), flush=True)


if __name__ == "__main__":
    main()
