"""Which backend each of a model's linear layers multiplies with, chosen at load.

configure(model, backend, device, dtype) routes every executor.linear.Linear of the model and
returns one ShapeChoice per distinct weight shape (out_features x in_features), each logged:
- "mkl": F.linear everywhere (MKL on the CPU; on a GPU, F.linear is all there is);
- "onednn": every layer prepacked for oneDNN (CPU, float32 only);
- "auto": on the CPU in float32, each shape is timed through both at the step's row counts
  STEP_ROWS (one decode, a decode batch, a prefill chunk) on one of its layers, a few
  alternated repetitions, best of each; the faster backend at a timed M serves the rows from
  the geometric midpoint below it to the one above. A row count whose one call would cost
  over MAX_TIMED_FLOP is timed at the largest M within it instead (the vocabulary
  projection). Elsewhere: mkl.
Where oneDNN is unavailable or raises, layers use F.linear, and the log says why.
int8/int4 kernels are not candidates (yet).
"""
from __future__ import annotations

import collections
import logging
import math
import time
from dataclasses import dataclass, field

import torch

from executor.linear import BACKENDS, Linear

CHOICES = ("auto", *BACKENDS)
STEP_ROWS = (1, 64, 512)
MAX_TIMED_FLOP = 2e9
REPS = 3

log = logging.getLogger("pagedserve.executor")


@dataclass
class ShapeChoice:
    """The routes of every layer of one weight shape, and what was measured (seconds per call,
    by M and backend; empty when the backend was forced)."""

    out_features: int
    in_features: int
    layers: int
    routes: list[tuple[int | None, str]]
    seconds: dict[int, dict[str, float]] = field(default_factory=dict)

    def gflops(self, rows: int, backend: str) -> float:
        return 2 * rows * self.out_features * self.in_features / self.seconds[rows][backend] / 1e9

    def describe(self) -> str:
        ranges, low = [], None
        for below, backend in self.routes:
            span = ("M<%d" % below if low is None else "%d<=M<%d" % (low, below)) if below else (
                "M>=%d" % low if low is not None else "all M")
            ranges.append(f"{backend} at {span}")
            low = below
        text = f"linear {self.out_features}x{self.in_features} ({self.layers} layers): " + ", ".join(ranges)
        if self.seconds:
            text += "; GFLOP/s " + ", ".join(
                f"M={m} " + " / ".join(f"{b} {self.gflops(m, b):.1f}" for b in t)
                for m, t in self.seconds.items())
        return text

    def as_dict(self) -> dict:
        return {"shape": [self.out_features, self.in_features], "layers": self.layers,
                "routes": [[below, backend] for below, backend in self.routes],
                "gflops": {str(m): {b: self.gflops(m, b) for b in t} for m, t in self.seconds.items()}}


def onednn_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why oneDNN cannot serve here, or None."""
    if device.type != "cpu":
        return f"oneDNN serves the CPU only (device {device})"
    if dtype != torch.float32:
        return f"oneDNN is used for float32 only here (dtype {dtype})"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (torch.backends.mkldnn)"
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return "this torch build lacks torch.ops.mkldnn._linear_pointwise"
    return None


def configure(model: torch.nn.Module, backend: str = "auto", device: torch.device | str = "cpu",
              dtype: torch.dtype = torch.float32, rows: tuple[int, ...] = STEP_ROWS) -> list[ShapeChoice]:
    if backend not in CHOICES:
        raise ValueError(f"linear backend {backend!r}: want one of {', '.join(CHOICES)}")
    groups: dict[tuple[int, int], list[Linear]] = {}
    for m in model.modules():
        if isinstance(m, Linear):
            groups.setdefault(m.shape, []).append(m)
    why = onednn_unavailable(torch.device(device), dtype)
    if backend != "mkl" and why is not None:
        if backend == "onednn" or torch.device(device).type == "cpu":
            log.info("linear backend %s: %s; F.linear (mkl) for every layer", backend, why)
        backend = "mkl"
    choices = []
    for (n, k), layers in groups.items():
        if backend == "auto":
            seconds = time_shape(layers[0], rows)
            routes = routes_from(seconds) if seconds else [(None, "mkl")]
        else:
            seconds, routes = {}, [(None, backend)]
        for layer in layers:
            layer.route(routes)
            if layer.routes != routes:  # its prepack failed (it logged why): the shape on F.linear
                routes = [(None, "mkl")]
                for done in layers:
                    done.route(routes)
                break
        choice = ShapeChoice(n, k, len(layers), routes, seconds)
        log.info("%s", choice.describe())
        choices.append(choice)
    shared = collections.Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    dropped = sum(layer.drop_dense() for layers in groups.values() for layer in layers
                  if layer.weight is not None and shared[id(layer.weight)] == 1)
    if dropped:
        log.info("linear: %d layers on oneDNN at every M hold only their prepacked weight", dropped)
    return choices


def time_shape(layer: Linear, rows: tuple[int, ...]) -> dict[int, dict[str, float]]:
    """Seconds per call of each backend at each affordable M; empty when oneDNN fails here
    (logged)."""
    n, k = layer.shape
    layer.route([(None, "onednn")])
    if layer.packed is None:
        return {}
    seconds: dict[int, dict[str, float]] = {}
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for m in rows:
            m = min(m, max(1, int(MAX_TIMED_FLOP // (2 * n * k))))
            if m in seconds:
                continue
            flop = 2 * m * n * k
            x = torch.randn(m, k, generator=g, dtype=layer.weight.dtype)
            calls = max(1, min(20, int(5e7 / flop)))
            best: dict[str, float] = {}
            try:
                for b in BACKENDS:
                    layer.run(b, x)  # warm
                for _ in range(REPS):
                    for b in BACKENDS:
                        t = time.perf_counter()
                        for _ in range(calls):
                            layer.run(b, x)
                        best[b] = min(best.get(b, math.inf), (time.perf_counter() - t) / calls)
            except Exception as e:  # noqa: BLE001  (oneDNN failed at this M: F.linear)
                log.warning("linear %dx%d: oneDNN failed while timed at M=%d (%r); F.linear (mkl)",
                            n, k, m, e)
                return {}
            seconds[m] = best
    return seconds


def routes_from(seconds: dict[int, dict[str, float]]) -> list[tuple[int | None, str]]:
    """The faster backend per timed M, boundaries at the geometric midpoints, equal
    neighbours merged."""
    ms = sorted(seconds)
    routes: list[tuple[int | None, str]] = []
    for i, m in enumerate(ms):
        best = min(seconds[m], key=seconds[m].get)
        below = math.ceil(math.sqrt(m * ms[i + 1])) if i + 1 < len(ms) else None
        if routes and routes[-1][1] == best:
            routes[-1] = (below, best)
        else:
            routes.append((below, best))
    return routes
