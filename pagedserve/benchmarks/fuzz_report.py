"""The fuzzer's findings: what it counts while it runs, the report it writes, and the
invariants a report breaks.

Contract: a Recorder takes every probe's Outcome and every Reference; `report(...)` is a
JSON-ready dict: `outcomes` (count per status, e.g. "http 400", "grpc OK",
"disconnected"), `by_category`, `server_errors` (each with the probe's index, category,
request and answer, truncated), `references` (counts, `mismatches` and `errors`), `health`
(pagedserve.benchmarks.fuzz_watch.health_summary plus its notable polls: slow or not 200) and `after` (memsvc's referenced
blocks and sequences once settled). `violations(report, health_p99_ms)` lists, in words,
each invariant broken: a 5xx (or no answer) to any request, a reference answer unequal to
its fresh computation, a block or sequence still held after the run, a /health poll not
answered 200, and (only when `health_p99_ms` is given: the bench, never a test) a /health
p99 over that bound.
"""
from __future__ import annotations

from pagedserve.benchmarks.fuzz_probe import Outcome, Probe, truncate
from pagedserve.benchmarks.fuzz_reference import Reference

KEEP = 50  # server errors, mismatches and reference errors kept in full in the report


class Recorder:
    def __init__(self):
        self.outcomes: dict[str, int] = {}
        self.by_category: dict[str, dict[str, int]] = {}
        self.seconds: dict[str, float] = {}  # per category, summed over its probes
        self.server_errors: list[dict] = []
        self.server_error_count = 0
        self.references: list[Reference] = []

    def probe(self, probe: Probe, outcome: Outcome) -> None:
        self.outcomes[outcome.status] = self.outcomes.get(outcome.status, 0) + 1
        cat = self.by_category.setdefault(probe.category, {})
        cat[outcome.status] = cat.get(outcome.status, 0) + 1
        self.seconds[probe.category] = self.seconds.get(probe.category, 0.0) + outcome.seconds
        if outcome.server_error:
            self.server_error_count += 1
            if len(self.server_errors) < KEEP:
                self.server_errors.append({"index": probe.index, "category": probe.category,
                                           "status": outcome.status, "answer": outcome.detail,
                                           "seconds": round(outcome.seconds, 2), "request": probe.describe()})

    def reference(self, ref: Reference) -> None:
        self.references.append(ref)

    def report(self, config: dict, duration_s: float, health: dict, after: dict) -> dict:
        refs = self.references
        mismatches = [r for r in refs if r.mismatch]
        errors = [r for r in refs if r.errors]
        return {
            "config": config, "duration_s": round(duration_s, 1),
            "requests": sum(self.outcomes.values()), "outcomes": dict(sorted(self.outcomes.items())),
            "by_category": {k: dict(sorted(v.items())) for k, v in sorted(self.by_category.items())},
            "seconds_by_category": {k: round(v, 1) for k, v in sorted(self.seconds.items())},
            "server_error_count": self.server_error_count, "server_errors": self.server_errors,
            "references": {
                "checked": len(refs), "compared": sum(1 for r in refs if r.cached is not None and r.fresh is not None),
                "by_kind": {k: sum(1 for r in refs if r.kind == k) for k in ("shared", "fresh", "none")},
                "mismatch_count": len(mismatches), "error_count": len(errors),
                "server_error_count": sum(1 for r in errors if r.server_error),
                "mismatches": [_ref(r) for r in mismatches[:KEEP]], "errors": [_ref(r) for r in errors[:KEEP]]},
            "health": health, "after": after,
        }


def _ref(r: Reference) -> dict:
    return {"api": r.api, "kind": r.kind, "after_probe": r.after, "prompt": truncate(r.prompt, 120),
            "cached": r.cached, "fresh": r.fresh, "errors": r.errors, "server_error": r.server_error}


def violations(report: dict, health_p99_ms: float | None = None) -> list[str]:
    out = []
    if report["server_error_count"]:
        out.append(f"{report['server_error_count']} requests answered 5xx (or not at all)")
    refs = report["references"]
    if refs["mismatch_count"]:
        out.append(f"{refs['mismatch_count']} reference answers differ from their fresh computation")
    if refs["server_error_count"]:
        out.append(f"{refs['server_error_count']} reference requests failed by the server's fault")
    after = report["after"]
    if after.get("blocks_referenced") != 0 or after.get("num_sequences") != 0:
        out.append(f"after the run memsvc holds {after.get('blocks_referenced')} blocks and "
                   f"{after.get('num_sequences')} sequences")
    health = report["health"]
    bad = {s: n for s, n in health["statuses"].items() if s != "200"}
    if bad or not health["polls"]:
        out.append(f"/health answered other than 200: {bad} of {health['polls']} polls")
    if health_p99_ms is not None and health["p99_ms"] > health_p99_ms:
        out.append(f"/health p99 {health['p99_ms']} ms over {health_p99_ms} ms (max {health['max_ms']} ms)")
    return out
