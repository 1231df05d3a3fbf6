"""The fuzzer's requests: probe `index` of a run with seed `seed`, over both public APIs.

Contract: `make_probe(seed, index, target, prefixes, categories)` is a pure function of
its arguments: the same seed and index give the same Probe (body bytes included), so a
report's seed and index reproduce any request it names. The category is drawn by WEIGHTS
(HTTP about 80%, gRPC 20%); a probe's prompt starts with a fresh prefix (never used before
in the run) with its category's FRESH probability, else with one of the shared ones, so
that a reference request after it can show a prefix-cache block it left wrong. FRESH is
highest for the categories whose requests reach the model with hostile parameters, and
zero for /tokenize, /detokenize and raw bytes, which compute nothing.
"""
from __future__ import annotations

import random

from pagedserve.benchmarks import fuzz_grpc, fuzz_http, fuzz_http_shapes
from pagedserve.benchmarks.fuzz_http import Target
from pagedserve.benchmarks.fuzz_prefixes import Prefixes
from pagedserve.benchmarks.fuzz_probe import Probe

GENERATORS = {
    "numbers": fuzz_http.numbers, "types": fuzz_http.types, "unicode": fuzz_http.unicode,
    "beam_n": fuzz_http.beam_n, "disconnect": fuzz_http.disconnect, "huge": fuzz_http_shapes.huge,
    "structured": fuzz_http_shapes.structured, "tools": fuzz_http_shapes.tools,
    "tokenize": fuzz_http_shapes.tokenize, "raw": fuzz_http_shapes.raw, "grpc": fuzz_grpc.grpc_probe,
}
WEIGHTS = {"numbers": 18, "types": 10, "unicode": 10, "beam_n": 8, "disconnect": 6, "huge": 5,
           "structured": 10, "tools": 8, "tokenize": 4, "raw": 4, "grpc": 20}
FRESH = {"numbers": 0.5, "unicode": 0.5, "beam_n": 0.5, "grpc": 0.5, "types": 0.3, "structured": 0.3,
         "disconnect": 0.3, "tools": 0.2, "huge": 0.1, "tokenize": 0.0, "raw": 0.0}


def make_probe(seed: int, index: int, target: Target, prefixes: Prefixes,
               categories: tuple[str, ...] | None = None) -> Probe:
    """Probe `index` of the run `seed`; `categories` limits the draw to those (a focused run)."""
    rng = random.Random(f"fuzz/{seed}/{index}")
    names = [c for c in WEIGHTS if categories is None or c in categories]
    category = rng.choices(names, weights=[WEIGHTS[c] for c in names])[0]
    fresh = rng.random() < FRESH[category]
    prefix = prefixes.fresh(index) if fresh else prefixes.shared(rng.randrange(prefixes.count))
    fields = GENERATORS[category](rng, prefix, target)
    return Probe(index=index, category=category, prefix=prefix, fresh_prefix=fresh, **fields)
