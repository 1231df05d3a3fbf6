"""Latency and throughput figures of a serving run, from per-request timings."""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class RequestTiming:
    start: float
    token_times: list[float] = field(default_factory=list)  # arrival of each output token
    end: float = 0.0
    output_tokens: int = 0
    status: str = "ok"  # or a gRPC status name

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.start

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float:
        """Time per output token after the first."""
        n = self.output_tokens - 1
        return (self.end - self.token_times[0]) / n if n > 0 else 0.0


def _summary(values: list[float]) -> dict:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    s = sorted(values)
    return {"mean": statistics.fmean(s), "median": statistics.median(s),
            "p99": s[min(len(s) - 1, int(round(0.99 * (len(s) - 1))))]}


def summarize(timings: list[RequestTiming], duration: float, *, slo_ttft: float | None = None,
              slo_tpot: float | None = None) -> dict:
    ok = [t for t in timings if t.status == "ok" and t.token_times]
    itl = [b - a for t in ok for a, b in zip(t.token_times, t.token_times[1:])]
    good = [t for t in ok if (slo_ttft is None or t.ttft <= slo_ttft)
            and (slo_tpot is None or t.tpot <= slo_tpot)]
    errors: dict[str, int] = {}
    for t in timings:
        if t.status != "ok":
            errors[t.status] = errors.get(t.status, 0) + 1
    out_tokens = sum(t.output_tokens for t in ok)
    return {
        "completed": len(ok), "errors": errors, "duration_s": duration,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_token_throughput": out_tokens / duration if duration else 0.0,
        "ttft_s": _summary([t.ttft for t in ok]),
        "tpot_s": _summary([t.tpot for t in ok if t.output_tokens > 1]),
        "itl_s": _summary(itl),
        "e2e_s": _summary([t.e2e for t in ok]),
        "normalized_latency_s_per_token": (
            statistics.fmean(t.e2e / t.output_tokens for t in ok if t.output_tokens) if ok else 0.0),
        "goodput_requests_per_s": len(good) / duration if duration else 0.0,
    }
