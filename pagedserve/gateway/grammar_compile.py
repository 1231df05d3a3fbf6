"""A guided spec built by xgrammar on the gateway, as the executor will build it
(pagedserve.executor.logits_mask), so that a grammar too slow to build is found at admission within
the request's budget (pagedserve.gateway.grammar_budget), never in a step.

- `grammar_of(kind, spec)`: the tokenizer-independent grammar; ValueError (xgrammar's
  message, without its source location) when the spec does not parse.
- `bind(tokenizer, vocab_size, stop_token_ids)`: the model's tokenizer, once it is known
  (pagedserve.gateway.main, when the executor's tokenizer is loaded); from then on
  `compile_with_tokenizer(grammar)` builds the grammar's token masks with it, as the
  executor will. Without a tokenizer bound (in-process gateways) it does nothing. The
  compiled grammar is dropped: only whether it compiles, and how long that takes, matter.
Safe to call from several threads: xgrammar releases the GIL while it works.
"""
from __future__ import annotations

import json
import logging
import re
import threading

import xgrammar as xgr  # here, not in a worker: importing it there races the tokenizer's import

log = logging.getLogger("pagedserve.gateway")

_compiler = None
_lock = threading.Lock()


def grammar_of(kind: str, spec: str):
    try:
        if kind == "json_schema":
            return xgr.Grammar.from_json_schema(spec, any_whitespace=False)
        if kind == "json_object":
            return xgr.Grammar.builtin_json_grammar()
        if kind == "regex":
            return xgr.Grammar.from_regex(spec)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_grammar(json.loads(spec)))
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(spec)
        if kind == "structural_tag":
            return xgr.Grammar.from_structural_tag(spec)
    except Exception as e:  # xgrammar raises its own types for bad input
        raise ValueError(_message(e)) from None
    raise ValueError(f"unknown kind {kind!r}")


def choice_grammar(choices) -> str:
    """EBNF that matches exactly one of `choices` (the executor builds the same)."""
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise ValueError("must be a non-empty list of strings")
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def bind(tokenizer, vocab_size: int, stop_token_ids=None) -> None:
    """Compile with `tokenizer` from now on; a tokenizer xgrammar cannot read leaves the
    check tokenizer-independent (logged)."""
    global _compiler
    try:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids or []) or None)
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    except Exception as e:
        log.warning("grammars are checked without the tokenizer (xgrammar cannot read it: %s)", e)
        compiler = None
    with _lock:
        _compiler = compiler


def unbind() -> None:
    global _compiler
    with _lock:
        _compiler = None


def compile_with_tokenizer(grammar) -> None:
    """Build `grammar`'s token masks with the bound tokenizer (nothing when none is bound);
    ValueError if xgrammar refuses it."""
    with _lock:
        compiler = _compiler
    if compiler is None:
        return
    try:
        compiler.compile_grammar(grammar)
    except Exception as e:
        raise ValueError(_message(e)) from None


def _message(e: Exception) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return re.sub(r"^\[[^\]]*\] \S+: ", "", text)
