"""Timing a linear layer's backends at the row counts a step uses (for pagedserve.executor.linear_backend).

time_shape(layer, rows) -> Timing: {M: {backend: seconds per call}}, best of REPS alternated
rounds, with how far the rounds spread and the share of the CPUs other work took meanwhile
(pagedserve.executor.linear_idle: what makes a timing an idle one).
A row count below COLD_BELOW (a decode of a few sequences) is timed with the layer's weight
out of the cache, as a decode step meets it: between two uses of one layer the step streams
every other weight of the model through the cache, and a model larger than the last-level
cache finds none of it there. Before each such call a scratch buffer of twice that cache's
size (at most MAX_SWEEP_BYTES) is read. Timed warm instead, MKL looked faster at one row on
the gate/up weight, resident; cold it was 2.9x slower, and the decode step 1.4x
(docs/benchmark-history.md, "Decode steps measured as they run", issue 25).
Larger M are compute-bound and timed warm, several calls in a row. "dot" (the C++ kernel on
the dense weight, pagedserve.kernels.linear_cpu) and "panel" (the C++ kernel on its own packed
copy, pagedserve.kernels.panel_cpu) are timed beside MKL and oneDNN where they can serve the
shape (timed_backends); prepare_timed makes each copy.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import torch

from pagedserve.executor.linear import PACKED, Linear
from pagedserve.kernels import linear_cpu, panel_cpu
from pagedserve.executor.linear_idle import OtherWork, why_busy
from pagedserve.wire.cpu_info import last_level_cache_bytes

TIMED = ("mkl", "onednn", "dot", "panel")  # what "auto" chooses among (int8, int4 change the outputs: opt-in only)
MAX_TIMED_FLOP = 8e9  # one call at most (a 2,048-row prefill chunk of a 3072x576 layer is 7.2e9)
REPS = 3
COLD_BELOW = 8
COLD_CALLS = 5
DEFAULT_LLC = 32 << 20  # when sysfs does not say
MAX_SWEEP_BYTES = 512 << 20

log = logging.getLogger("pagedserve.executor")


@dataclass
class Timing:
    """Seconds per call by M and backend (empty: oneDNN failed here), the largest spread of
    one backend's rounds at one warm M (the second fastest over the fastest), and the share of
    this process's CPUs other work took while it ran (None: unknown).
    One slow round is noise the best of the rounds already drops, and a cold call at a few rows
    is noisy by design: on an idle AMD EPYC 26/2 one round of three came out up to 2.25x slower
    (oneDNN, 576x1536 at 512 rows) and cold one-row rounds up to 1.6x apart (MKL): that marked
    5 of 12 idle loads busy; this spread, 0 of 12 (BENCHMARKS.md, issue 44)."""

    seconds: dict[int, dict[str, float]] = field(default_factory=dict)
    spread: float = 1.0
    others: float | None = None

    def busy(self) -> str | None:
        """Why this is not an idle timing, or None (pagedserve.executor.linear_idle.why_busy)."""
        return why_busy(self.others, self.spread)


class Sweep:
    """Reads a buffer larger than the last-level cache, evicting whatever was there."""

    def __init__(self):
        llc = last_level_cache_bytes() or DEFAULT_LLC
        self.buffer = torch.ones(min(2 * llc, MAX_SWEEP_BYTES) // 4)

    def __call__(self) -> None:
        self.buffer.sum()


def _warm(layer: Linear, backend: str, x: torch.Tensor, calls: int) -> float:
    t = time.perf_counter()
    for _ in range(calls):
        layer.run(backend, x)
    return (time.perf_counter() - t) / calls


def _cold(layer: Linear, backend: str, x: torch.Tensor, sweep: Sweep) -> float:
    best = math.inf
    for _ in range(COLD_CALLS):
        sweep()
        t = time.perf_counter()
        layer.run(backend, x)
        best = min(best, time.perf_counter() - t)
    return best


def timed_backends(layer: Linear) -> tuple[str, ...]:
    """The backends of TIMED that can serve this layer here."""
    why = {"dot": linear_cpu.unavailable, "panel": panel_cpu.unavailable}
    return tuple(b for b in TIMED if b not in why or why[b](layer.weight) is None)


def prepare_timed(layer: Linear) -> tuple[str, ...]:
    """The backends of timed_backends(layer) ready to run, each copy of its own made (a route
    names each; run() names the backend); where a copy fails (logged), the dense weight's only."""
    timed = timed_backends(layer)
    packed = [b for b in timed if b in PACKED]
    layer.route([(1, b) for b in packed[1:]] + [(None, packed[0])])
    return tuple(b for b in timed if b not in PACKED or b in layer.prepared)


def time_shape(layer: Linear, rows: tuple[int, ...]) -> Timing:
    """Each backend at each affordable M; no seconds when oneDNN fails here (logged)."""
    n, k = layer.shape
    timed = prepare_timed(layer)
    if "onednn" not in timed:
        return Timing()
    watch = OtherWork()
    seconds: dict[int, dict[str, float]] = {}
    spread = 1.0
    g = torch.Generator().manual_seed(0)
    sweep = Sweep() if any(m < COLD_BELOW for m in rows) else None
    with torch.inference_mode():
        for m in rows:
            m = min(m, max(1, int(MAX_TIMED_FLOP // (2 * n * k))))
            if m in seconds:
                continue
            flop = 2 * m * n * k
            x = torch.randn(m, k, generator=g, dtype=layer.weight.dtype)
            calls = max(1, min(20, int(5e7 / flop)))
            rounds: dict[str, list[float]] = {b: [] for b in timed}
            try:
                for b in timed:
                    layer.run(b, x)  # warm
                for _ in range(REPS):
                    for b in timed:
                        rounds[b].append(_cold(layer, b, x, sweep) if m < COLD_BELOW
                                         else _warm(layer, b, x, calls))
            except Exception as e:  # noqa: BLE001  (oneDNN failed at this M: F.linear)
                log.warning("linear %dx%d: oneDNN failed while timed at M=%d (%r); F.linear (mkl)",
                            n, k, m, e)
                return Timing()
            seconds[m] = {b: min(r) for b, r in rounds.items()}
            if m >= COLD_BELOW:
                spread = max(spread, *(sorted(r)[1] / max(min(r), 1e-9) for r in rounds.values()))
    return Timing(seconds, spread, watch.share())
