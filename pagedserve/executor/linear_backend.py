"""Which backend each of a model's linear layers multiplies with, chosen at load.

Planner(backend, device, dtype) routes pagedserve.executor.linear.Linear layers as the model is built
(place, called per decoder layer by the loader) and returns one ShapeChoice per distinct
weight shape (out_features x in_features), each logged (finish); configure(model, ...) does
the same for a model already built. Backends:
- "mkl": F.linear everywhere (MKL on the CPU; on a GPU, F.linear is all there is);
- "onednn": every layer prepacked for oneDNN (CPU, float32 only);
- "dot": every layer through the C++ kernel on its dense weight (pagedserve.kernels.linear_cpu;
  CPU float32, K a multiple of 8);
- "panel": every layer through the C++ kernel on its weight packed in column panels
  (pagedserve.kernels.panel_cpu; CPU float32);
- "int8": every layer on per-channel int8 weights (pagedserve.executor.linear_int8; CPU; not exact, so
  opt-in only, its accuracy against float32 measured in BENCHMARKS.md); a layer the kernel
  cannot take (in_features not a multiple of 16) stays on F.linear, logged;
- "int4": every layer whose float32 weight is exactly a Q4_1 GGUF's on its own 4-bit weights
  (pagedserve.executor.linear_int4; CPU float32; not exact, opt-in only, measured like int8); a shape
  that is not Q4_1 (the default model's LM head: its tied embedding is Q8_0) is timed as for
  auto, logged. Where the kernel is missing, or the first decoder layer holds no Q4_1 weight,
  it raises (ValueError naming the fix) rather than serve something else;
- "auto": on the CPU in float32, each shape is timed through MKL, oneDNN, "dot" and "panel" at the step's row counts
  STEP_ROWS (one decode, a decode batch, a prefill chunk) on one of its layers, a few
  alternated repetitions, best of each, one row with the weight out of the cache as a
  decode step meets it (pagedserve.executor.linear_timing); the faster backend at a timed M (one on
  the dense weight only by more than PREFER_MARGIN, or at every M: linear_auto.routes_from)
  serves the rows from the geometric midpoint below it to the one above, with one packed copy
  at most: oneDNN's or the panels, whichever is faster over every M (a shape that would mix it
  with the dense weight's backends, where they win by under MIXED_MARGIN, goes all packed). A row count whose one call would cost over
  linear_timing.MAX_TIMED_FLOP is timed at the largest M within it instead (the vocabulary
  projection). Only timings taken idle decide and are kept per machine, and kept ones are
  checked at load (pagedserve.executor.linear_auto, linear_idle, linear_plan_cache); a busy machine
  gets oneDNN at every M. Each ShapeChoice says where its plan came from. Elsewhere: mkl.
Where oneDNN is unavailable or raises, layers use F.linear, and the log says why.
"auto" never picks int8 or int4.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from pagedserve.executor import linear_int4, linear_int8
from pagedserve.executor import linear_plan_cache as plan_cache
from pagedserve.executor.linear import BACKENDS, Linear
from pagedserve.executor.linear_auto import (  # noqa: F401
    MIXED_MARGIN,
    PREFER_MARGIN,
    AutoPlan,
    routes_from,
)
from pagedserve.executor.linear_timing import TIMED  # noqa: F401  (what auto chooses among)
from pagedserve.kernels import linear_cpu, panel_cpu

CHOICES = ("auto", *BACKENDS)
STEP_ROWS = (1, 64, 512, 2048)
SOURCES = {"forced": "as named", "timed": "timed idle at this load (kept)",
           "cache": "kept from an earlier load", "busy": "oneDNN, the machine busy (nothing kept)",
           "untimed": "F.linear, oneDNN unavailable or failed"}

log = logging.getLogger("pagedserve.executor")
int8_unavailable = linear_int8.unavailable


@dataclass
class ShapeChoice:
    """The routes of every layer of one weight shape, what was measured (seconds per call,
    by M and backend; empty when the backend was forced), and where the plan came from (one
    of SOURCES, and a note: linear_auto.Decision)."""

    out_features: int
    in_features: int
    layers: int
    routes: list[tuple[int | None, str]]
    seconds: dict[int, dict[str, float]] = field(default_factory=dict)
    source: str = "forced"
    note: str = ""

    def gflops(self, rows: int, backend: str) -> float:
        return 2 * rows * self.out_features * self.in_features / self.seconds[rows][backend] / 1e9

    def describe(self) -> str:
        ranges, low = [], None
        for below, backend in self.routes:
            span = (f"M<{below}" if low is None else f"{low}<=M<{below}") if below else (
                f"M>={low}" if low is not None else "all M")
            ranges.append(f"{backend} at {span}")
            low = below
        text = f"linear {self.out_features}x{self.in_features} ({self.layers} layers): " + ", ".join(ranges)
        if self.seconds:
            text += "; GFLOP/s " + ", ".join(
                f"M={m} " + " / ".join(f"{b} {self.gflops(m, b):.1f}" for b in t)
                for m, t in sorted(self.seconds.items()))
        if self.source != "forced":
            text += f" [{self.source}{': ' + self.note if self.note else ''}]"
        return text

    def as_dict(self) -> dict:
        return {"shape": [self.out_features, self.in_features], "layers": self.layers,
                "routes": [[below, backend] for below, backend in self.routes],
                "gflops": {str(m): {b: self.gflops(m, b) for b in t} for m, t in self.seconds.items()},
                "source": self.source, "note": self.note}


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
        check = {"int8": int8_unavailable, "dot": linear_cpu.unavailable_for,
                 "panel": panel_cpu.unavailable_for}.get(backend, onednn_unavailable)
        why = check(device, dtype)
        if backend not in ("mkl", "int4") and why is not None:
            if backend != "auto" or device.type == "cpu":
                log.info("linear backend %s: %s; F.linear (mkl) for every layer", backend, why)
            backend = "mkl"
        self.backend, self.rows = backend, rows
        self.auto = AutoPlan(rows)
        self.choices: list[ShapeChoice] = []
        self._current: dict[tuple[int, int], ShapeChoice] = {}
        self._placed: set[int] = set()
        self.dropped = 0
        self.not_q4_1: list[str] = []  # int4: why each shape left on float32 is

    def place(self, module: torch.nn.Module) -> None:
        first = not self._placed
        if self.backend == "auto" and self.onednn:
            self.auto.check([m for m in module.modules() if isinstance(m, Linear) and id(m) not in
                             self._placed and m.shape not in self._current])
        for layer in module.modules():
            if not isinstance(layer, Linear) or id(layer) in self._placed:
                continue
            self._placed.add(id(layer))
            choice = self._current.get(layer.shape) or self._decide(layer)
            layer.route(choice.routes)
            self.dropped += layer.drop_dense()
            if layer.routes != choice.routes:  # it fell back (logged): the shape on F.linear
                if choice.layers:
                    choice = ShapeChoice(*layer.shape, 0, [(None, "mkl")], source="untimed",
                                         note="a layer could not be prepared (logged)")
                    self.choices.append(choice)
                    self._current[layer.shape] = choice
                else:
                    choice.routes, choice.source = [(None, "mkl")], "untimed"
                    choice.note = "its layer could not be prepared (logged)"
            choice.layers += 1
        if self.backend == "int4" and first and self._placed and not any(
                b == "int4" for c in self.choices for _, b in c.routes):
            raise ValueError(f"--linear-backend int4: the first decoder layer holds no Q4_1 weights "
                             f"({self.not_q4_1[0]}); int4 serves a Q4_1 GGUF (the default model) "
                             f"in float32: use --linear-backend auto for this model")

    def finish(self) -> list[ShapeChoice]:
        for choice in self.choices:
            log.info("%s", choice.describe())
        if self.backend in ("auto", "int4"):
            log.info("plan of the linear layers: %s", summary(self.choices))
        if self.dropped:
            log.info("linear: %d layers on one backend other than mkl at every M hold only its copy "
                     "of their weight", self.dropped)
        return self.choices

    def _decide(self, layer: Linear) -> ShapeChoice:
        choice = ShapeChoice(*layer.shape, 0, [(None, self.backend)])
        if self.backend == "int4":
            try:
                layer.route(choice.routes, {"int4": linear_int4.pack(layer.weight)})
            except linear_int4.NotQ4_1 as e:
                self.not_q4_1.append(str(e))
                log.info("%s: float32 for this shape, timed as for auto", e)
                choice = self._timed(layer)
        elif self.backend == "auto":
            choice = self._timed(layer)
        self.choices.append(choice)
        self._current[layer.shape] = choice
        return choice

    def _timed(self, layer: Linear) -> ShapeChoice:
        if not self.onednn:
            return ShapeChoice(*layer.shape, 0, [(None, "mkl")], source="untimed", note="no oneDNN here")
        d = self.auto.decide(layer)
        return ShapeChoice(*layer.shape, 0, d.routes, d.seconds, d.source, d.note)


def configure(model: torch.nn.Module, backend: str = "auto", device: torch.device | str = "cpu",
              dtype: torch.dtype = torch.float32, rows: tuple[int, ...] = STEP_ROWS) -> list[ShapeChoice]:
    """Route every linear layer of a model already built (Planner, placed all at once)."""
    planner = Planner(backend, device, dtype, rows)
    planner.place(model)
    return planner.finish()


def summary(choices: list[ShapeChoice]) -> str:
    """Where a plan came from, in a line: how many shapes each way, and the cache file."""
    counts: dict[str, int] = {}
    for c in choices:
        counts[c.source] = counts.get(c.source, 0) + 1
    text = "; ".join(f"{n} shape{'s' * (n > 1)} {SOURCES[s]}" for s, n in counts.items())
    return text + f" (cache {plan_cache.path()})" if {"timed", "cache", "busy"} & set(counts) else text
