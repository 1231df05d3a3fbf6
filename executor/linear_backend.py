"""Which backend each of a model's linear layers multiplies with, chosen at load.

Planner(backend, device, dtype) routes executor.linear.Linear layers as the model is built
(place, called per decoder layer by the loader) and returns one ShapeChoice per distinct
weight shape (out_features x in_features), each logged (finish); configure(model, ...) does
the same for a model already built. Backends:
- "mkl": F.linear everywhere (MKL on the CPU; on a GPU, F.linear is all there is);
- "onednn": every layer prepacked for oneDNN (CPU, float32 only);
- "int8": every layer on per-channel int8 weights (executor.linear_int8; CPU; not exact, so
  opt-in only, its accuracy against float32 measured in BENCHMARKS.md); a layer the kernel
  cannot take (in_features not a multiple of 16) stays on F.linear, logged;
- "int4": every layer whose float32 weight is exactly a Q4_1 GGUF's on its own 4-bit weights
  (executor.linear_int4; CPU float32; not exact, opt-in only, measured like int8); a shape
  that is not Q4_1 (the default model's LM head: its tied embedding is Q8_0) is timed as for
  auto, logged. Where the kernel is missing, or the first decoder layer holds no Q4_1 weight,
  it raises (ValueError naming the fix) rather than serve something else;
- "auto": on the CPU in float32, each shape is timed through both at the step's row counts
  STEP_ROWS (one decode, a decode batch, a prefill chunk) on one of its layers, a few
  alternated repetitions, best of each, one row with the weight out of the cache as a
  decode step meets it (executor.linear_timing; kept per machine: executor.linear_plan_cache); the
  faster backend at a timed M (MKL only by more than PREFER_MARGIN) serves the rows from
  the geometric midpoint below it to the one above (a shape that would mix the two, where
  MKL wins by under MIXED_MARGIN, goes all oneDNN: one copy of its weight). A row count
  whose one call would cost over linear_timing.MAX_TIMED_FLOP is timed at the largest M within it instead
  (the vocabulary projection). Elsewhere: mkl.
Where oneDNN is unavailable or raises, layers use F.linear, and the log says why.
"auto" never picks int8 or int4.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch

from executor import linear_int4, linear_int8, linear_plan_cache as plan_cache
from executor.linear import BACKENDS, Linear
from executor.linear_timing import TIMED, time_shape  # noqa: F401  (TIMED: what auto chooses among)

CHOICES = ("auto", *BACKENDS)
STEP_ROWS = (1, 64, 512)
PREFER_MARGIN = 1.10  # MKL serves an M only where it is faster than oneDNN by more than this:
# a win inside the timing noise would flip from one load to the next
MIXED_MARGIN = 1.25  # oneDNN at most 25% slower than MKL: one copy of the weight beats two
# (measured, AMD EPYC: where MKL wins, at M = 1 on the 576-wide projections, by 15-40%, that is
# <= 0.7 ms of a ~25 ms decode step, for 105 MiB more weights)

log = logging.getLogger("pagedserve.executor")
int8_unavailable = linear_int8.unavailable


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


class Planner:
    """Routes linear layers as a model is built. place(module) routes every Linear under it
    not placed yet: the first layer of each weight shape decides the shape's routes (timed
    on it, for "auto"), the others follow; a layer on oneDNN at every M that owns its weight
    keeps only the prepacked copy (Linear.drop_dense), at once, so the dense weights never
    pile up. finish() logs and returns one ShapeChoice per shape.

    A layer whose prepack or check call fails runs on F.linear (it logs why) and so do the
    shape's layers placed after it; the ones placed before keep their routes (they passed
    their check; some may hold no dense weight any more), and the plan then lists the shape
    twice: its first routes, then F.linear."""

    def __init__(self, backend: str = "auto", device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, rows: tuple[int, ...] = STEP_ROWS):
        if backend not in CHOICES:
            raise ValueError(f"linear backend {backend!r}: want one of {', '.join(CHOICES)}")
        device = torch.device(device)
        if backend == "int4" and (why := linear_int4.unavailable(device, dtype)) is not None:
            raise ValueError(f"--linear-backend int4: {why}")
        self.onednn = onednn_unavailable(device, dtype) is None
        why = int8_unavailable(device, dtype) if backend == "int8" else onednn_unavailable(device, dtype)
        if backend not in ("mkl", "int4") and why is not None:
            if backend != "auto" or device.type == "cpu":
                log.info("linear backend %s: %s; F.linear (mkl) for every layer", backend, why)
            backend = "mkl"
        self.backend, self.rows = backend, rows
        self.choices: list[ShapeChoice] = []
        self._current: dict[tuple[int, int], ShapeChoice] = {}
        self._placed: set[int] = set()
        self.dropped = 0
        self.not_q4_1: list[str] = []  # int4: why each shape left on float32 is

    def place(self, module: torch.nn.Module) -> None:
        first = not self._placed
        for layer in module.modules():
            if not isinstance(layer, Linear) or id(layer) in self._placed:
                continue
            self._placed.add(id(layer))
            choice = self._current.get(layer.shape) or self._decide(layer)
            layer.route(choice.routes)
            self.dropped += layer.drop_dense()
            if layer.routes != choice.routes:  # it fell back (logged): the shape on F.linear
                if choice.layers:
                    choice = ShapeChoice(*layer.shape, 0, [(None, "mkl")])
                    self.choices.append(choice)
                    self._current[layer.shape] = choice
                else:
                    choice.routes = [(None, "mkl")]
            choice.layers += 1
        if self.backend == "int4" and first and self._placed and not any(
                b == "int4" for c in self.choices for _, b in c.routes):
            raise ValueError(f"--linear-backend int4: the first decoder layer holds no Q4_1 weights "
                             f"({self.not_q4_1[0]}); int4 serves a Q4_1 GGUF (the default model) "
                             f"in float32: use --linear-backend auto for this model")

    def finish(self) -> list[ShapeChoice]:
        for choice in self.choices:
            log.info("%s", choice.describe())
        if self.dropped:
            log.info("linear: %d layers on one backend other than mkl at every M hold only its copy "
                     "of their weight", self.dropped)
        return self.choices

    def _decide(self, layer: Linear) -> ShapeChoice:
        seconds, routes = {}, [(None, self.backend)]
        if self.backend == "int4":
            try:
                layer.route(routes, {"int4": linear_int4.pack(layer.weight)})
            except linear_int4.NotQ4_1 as e:
                self.not_q4_1.append(str(e))
                log.info("%s: float32 for this shape, timed as for auto", e)
                seconds, routes = self._timed(layer)
        elif self.backend == "auto":
            seconds, routes = self._timed(layer)
        choice = ShapeChoice(*layer.shape, 0, routes, seconds)
        self.choices.append(choice)
        self._current[layer.shape] = choice
        return choice

    def _timed(self, layer: Linear) -> tuple[dict[int, dict[str, float]], list[tuple[int | None, str]]]:
        if not self.onednn:
            return {}, [(None, "mkl")]
        k = plan_cache.key(layer.shape, layer.weight.dtype, self.rows)
        seconds = plan_cache.load(k)
        if seconds is not None:
            log.info("linear %dx%d: timings kept from an earlier load (%s)", *layer.shape, plan_cache.path())
        else:
            seconds = time_shape(layer, self.rows)
            if seconds:
                plan_cache.store(k, seconds)
        return seconds, routes_from(seconds) if seconds else [(None, "mkl")]


def configure(model: torch.nn.Module, backend: str = "auto", device: torch.device | str = "cpu",
              dtype: torch.dtype = torch.float32, rows: tuple[int, ...] = STEP_ROWS) -> list[ShapeChoice]:
    """Route every linear layer of a model already built (Planner, placed all at once)."""
    planner = Planner(backend, device, dtype, rows)
    planner.place(model)
    return planner.finish()


def routes_from(seconds: dict[int, dict[str, float]]) -> list[tuple[int | None, str]]:
    """The faster backend per timed M, boundaries at the geometric midpoints, equal
    neighbours merged; except that a shape which would mix backends goes to oneDNN at every M
    when oneDNN is within MIXED_MARGIN of MKL wherever MKL is faster (a mixed layer holds its
    weight twice, dense and packed: a win inside the timing noise is not worth that)."""
    ms = sorted(seconds)
    best = {m: "mkl" if seconds[m]["mkl"] * PREFER_MARGIN < seconds[m]["onednn"] else "onednn" for m in ms}
    if len(set(best.values())) > 1 and all(
            seconds[m]["onednn"] <= seconds[m]["mkl"] * MIXED_MARGIN for m in ms):
        best = dict.fromkeys(ms, "onednn")
    routes: list[tuple[int | None, str]] = []
    for i, m in enumerate(ms):
        below = math.ceil(math.sqrt(m * ms[i + 1])) if i + 1 < len(ms) else None
        if routes and routes[-1][1] == best[m]:
            routes[-1] = (below, best[m])
        else:
            routes.append((below, best[m]))
    return routes
