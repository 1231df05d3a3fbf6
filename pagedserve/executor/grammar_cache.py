"""The executor's compiled grammars (pagedserve.executor.logits_mask): compiled off the step, kept
within a byte budget.

Contract:
- `GrammarCache(compiler, cache_bytes)`: `compiled(kind, spec)` returns a Future of the
  xgrammar CompiledGrammar at once: done when it is kept, else the compile in progress (one
  per (kind, spec), on one of COMPILE_WORKERS threads; xgrammar releases the GIL while it
  compiles); `start(kind, spec)` only starts it, and costs a look-up when it is kept. A
  spec that does not compile fails its Future with ValueError and is tried again when asked
  again. `compiler` is called on a worker to get the xgrammar GrammarCompiler (built once,
  by its owner); its own cache should be off.
- Compiled grammars are kept while their bytes (xgrammar's `memory_size_bytes` plus the
  spec's) stay within `cache_bytes` (--grammar-cache-bytes), least recently used out; one
  larger than that alone is not kept. Matchers hold what they use, so dropping a grammar
  only costs a compile when it is asked for again.
"""
from __future__ import annotations

import collections
import json
import threading
from concurrent.futures import Future

from pagedserve.rpc.daemon_pool import DaemonPool

GRAMMAR_CACHE_BYTES = 256 << 20  # --grammar-cache-bytes
COMPILE_WORKERS = 2


def compile_grammar(compiler, kind: str, spec: str):
    """The xgrammar CompiledGrammar of a guided (kind, spec); ValueError when it is invalid."""
    import xgrammar as xgr

    try:
        if kind == "json_schema":
            return compiler.compile_json_schema(spec, any_whitespace=False)
        if kind == "json_object":
            return compiler.compile_builtin_json_grammar()
        if kind == "regex":
            return compiler.compile_regex(spec)
        if kind == "choice":
            choices = json.loads(spec)
            return compiler.compile_grammar(choice_grammar(choices))
        if kind == "grammar":
            return compiler.compile_grammar(spec)
        if kind == "structural_tag":
            return compiler.compile_structural_tag(spec)
    except (RuntimeError, ValueError, TypeError, xgr.exception.InvalidJSONError) as e:
        raise ValueError(str(e)) from None
    except Exception as e:  # xgrammar's own errors for bad grammars
        raise ValueError(f"{type(e).__name__}: {e}") from None
    raise ValueError(f"unknown guided_kind {kind!r}")


def choice_grammar(choices: list[str]) -> str:
    """EBNF that matches exactly one of `choices`."""
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise ValueError("guided_choice must be a non-empty list of strings")
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


class GrammarCache:
    def __init__(self, compiler, cache_bytes: int = GRAMMAR_CACHE_BYTES, workers: int = COMPILE_WORKERS):
        self.compiler = compiler
        self.cache_bytes = cache_bytes
        self._kept: collections.OrderedDict[tuple, tuple[object, int]] = collections.OrderedDict()
        self._bytes = 0
        self._compiling: dict[tuple, Future] = {}
        self._lock = threading.Lock()
        self._pool = DaemonPool(workers, "pagedserve-grammar-compile")

    @property
    def kept_bytes(self) -> int:
        with self._lock:
            return self._bytes

    def kept(self) -> list[tuple]:
        """The (kind, spec) kept, least recently used first."""
        with self._lock:
            return list(self._kept)

    def start(self, kind: str, spec: str) -> None:
        """Start compiling (kind, spec) unless it is kept or compiling: cheap when it is, for
        every guided sequence of every step."""
        key = (kind, spec)
        if key not in self._kept and key not in self._compiling:  # a racy look: compiled() decides
            self.compiled(kind, spec)

    def compiled(self, kind: str, spec: str) -> Future:
        key = (kind, spec)
        with self._lock:
            hit = self._kept.get(key)
            if hit is not None:
                self._kept.move_to_end(key)
                done: Future = Future()
                done.set_result(hit[0])
                return done
            pending = self._compiling.get(key)
            if pending is None:
                pending = self._compiling[key] = self._pool.submit(self._compile, key)
            return pending

    def _compile(self, key: tuple):
        try:
            grammar = compile_grammar(self.compiler(), *key)
        except BaseException:
            with self._lock:
                self._compiling.pop(key, None)
            raise
        size = int(getattr(grammar, "memory_size_bytes", 0)) + len(key[1])
        with self._lock:
            self._compiling.pop(key, None)
            self._kept[key] = (grammar, size)
            self._bytes += size
            while self._kept and self._bytes > self.cache_bytes:
                _, (_, dropped) = self._kept.popitem(last=False)
                self._bytes -= dropped
        return grammar
