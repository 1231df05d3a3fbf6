"""What the fuzzer watches besides its own requests: GET /health polled all run long, and
memsvc's referenced blocks once the run is over.

Contract: `HealthPoller(url, interval, busy)` polls `url`/health on its own thread (its
own synchronous client, so the fuzzer's event loop cannot delay a poll) every `interval`
seconds from `start()` to `stop()`; each poll is (seconds since start, status or None
when nothing answered within `timeout`, latency in seconds). A poll slower than
SLOW_S, or answered other than 200, is kept in `notable` with what `busy()` said was in
flight when it began and ended (probe labels), so it can be traced to the request behind it. `health_summary(polls)`:
count, statuses, p50 / p99 / max in ms, polls over SLOW_S. `settle(base_url, timeout)`
reads memsvc's `pagedserve:kv_cache_blocks{state="referenced"}` and
`pagedserve:num_sequences` through the gateway's /metrics until both are 0 (or the
timeout passes) and returns the last values read (None: not in the scrape), with the
gateway's `requests_running` and `requests_waiting` of the same scrape.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families

SLOW_S = 0.1


class HealthPoller:
    def __init__(self, url: str, interval: float = 0.05, busy: Callable[[], list[str]] | None = None,
                 timeout: float = 10.0):
        self.url = url.rstrip("/") + "/health"
        self.interval = interval
        self.busy = busy or (lambda: [])
        self.timeout = timeout
        self.polls: list[tuple[float, int | None, float]] = []
        self.notable: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fuzz-health", daemon=True)

    def start(self) -> "HealthPoller":
        self._thread.start()
        return self

    def stop(self) -> list[tuple[float, int | None, float]]:
        self._stop.set()
        self._thread.join()
        return self.polls

    def _run(self) -> None:
        t0 = time.monotonic()
        with httpx.Client(timeout=self.timeout) as client:
            while not self._stop.is_set():
                before = self.busy()
                start = time.monotonic()
                try:
                    status = client.get(self.url).status_code
                except httpx.HTTPError:
                    status = None
                latency = time.monotonic() - start
                self.polls.append((round(start - t0, 3), status, latency))
                if latency > SLOW_S or status != 200:
                    self.notable.append({"at_s": round(start - t0, 3), "ms": round(latency * 1e3, 1),
                                      "status": status, "in_flight": sorted(set(before) | set(self.busy()))})
                self._stop.wait(max(self.interval - latency, 0.0))


def _percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(int(q * len(sorted_values)), len(sorted_values) - 1)] if sorted_values else 0.0


def health_summary(polls: list[tuple[float, int | None, float]]) -> dict:
    latencies = sorted(p[2] for p in polls)
    statuses: dict[str, int] = {}
    for _, status, _ in polls:
        statuses[str(status)] = statuses.get(str(status), 0) + 1
    return {"polls": len(polls), "statuses": statuses,
            "p50_ms": round(_percentile(latencies, 0.5) * 1e3, 1),
            "p99_ms": round(_percentile(latencies, 0.99) * 1e3, 1),
            "max_ms": round((latencies[-1] if latencies else 0.0) * 1e3, 1),
            "over_100ms": sum(1 for x in latencies if x > SLOW_S)}


def memsvc_gauges(text: str) -> dict:
    """Referenced blocks and sequences of every memsvc in a /metrics scrape (summed), and the
    gateway's requests running and waiting."""
    out: dict = {"blocks_referenced": None, "num_sequences": None}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if "service" not in s.labels and s.name in ("pagedserve:num_requests_running",
                                                        "pagedserve:num_requests_waiting"):
                out["gateway_" + s.name.split(":num_")[1]] = int(s.value)
            if s.labels.get("service", "").startswith("memsvc"):
                if s.name == "pagedserve:kv_cache_blocks" and s.labels.get("state") == "referenced":
                    out["blocks_referenced"] = (out["blocks_referenced"] or 0) + int(s.value)
                elif s.name == "pagedserve:num_sequences":
                    out["num_sequences"] = (out["num_sequences"] or 0) + int(s.value)
    return out


def settle(base_url: str, timeout: float = 60.0) -> dict:
    start = time.monotonic()
    last: dict = {"blocks_referenced": None, "num_sequences": None, "error": None}
    with httpx.Client(timeout=10.0) as client:
        while True:
            try:
                last = {**memsvc_gauges(client.get(base_url + "/metrics").text), "error": None}
            except (httpx.HTTPError, ValueError) as e:
                last["error"] = f"{type(e).__name__}: {e}"
            if (last["blocks_referenced"] == 0 and last["num_sequences"] == 0) or \
                    time.monotonic() - start > timeout:
                return {**last, "settle_s": round(time.monotonic() - start, 1)}
            time.sleep(0.5)
